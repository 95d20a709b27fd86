"""Activation recompute (Megatron's selective / full, uniform / block): the same bits as without it.

* Every setting gives the loss and every parameter gradient of the run without recompute, bit
  for bit, and recomputes what it says (counted: layer forwards, attention-core calls).
* Controls that differ by construction: a recompute whose second forward is perturbed changes
  the gradients (so the comparison can fail); a forward drawing from torch's RNG gives the same
  bits under recompute only because the RNG state is restored -- with ``preserve_rng_state=False``
  the recomputed dropout mask is a new draw and the gradients differ.
* Memory: the bytes saved for backward fall from none to selective to full.
* The settings follow megatron-core's rules; bad ones, a KV cache and the vanilla control are refused.
* tpinv's megatron dropout replays, in a recompute, the sample ids of the checkpointed forwards
  it repeats, in order (megatron's recompute end to end: tests/distributed/test_megatron_recompute.py).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import tpinv.models.transformer as transformer
from tpinv.models import Transformer, get_config
from tpinv.models.recompute import Recompute
from tpinv.testing import assert_bits_differ, assert_same_bits, same_bits
from tpinv.testing.saved_activations import saved_activation_bytes
from tpinv.training import TrainConfig, train
from tpinv.training.config import parse_configs

LAYERS = 4
SETTINGS = {
    "selective": dict(granularity="selective"),
    "full-uniform-1": dict(granularity="full", method="uniform", num_layers=1),
    "full-uniform-2": dict(granularity="full", method="uniform", num_layers=2),
    "full-block-3": dict(granularity="full", method="block", num_layers=3),
}
#: Layer forwards per training step (recomputed layers run twice) and attention-core calls.
LAYER_CALLS = {"none": LAYERS, "selective": LAYERS, "full-uniform-1": 2 * LAYERS, "full-uniform-2": 2 * LAYERS,
               "full-block-3": LAYERS + 3}
CORE_CALLS = {"none": LAYERS, "selective": 2 * LAYERS, "full-uniform-1": 2 * LAYERS, "full-uniform-2": 2 * LAYERS,
              "full-block-3": LAYERS + 3}


def _model(name="qwen3-tiny", dtype=torch.bfloat16, recompute=None, hidden_dropout=0.0):
    torch.manual_seed(0)
    model = Transformer(get_config(name, num_layers=LAYERS, dtype=dtype), hidden_dropout=hidden_dropout,
                        dropout_seed=7).train()
    return model.set_recompute(**recompute) if recompute else model


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 12), generator=g), torch.randint(0, 256, (2, 12), generator=g)


def _step(model, monkeypatch=None):
    """``(loss, grads, layer forwards, attention-core calls)`` of one forward + backward."""
    calls = {"layers": 0, "core": 0}
    hooks = [layer.register_forward_pre_hook(lambda *_: calls.__setitem__("layers", calls["layers"] + 1))
             for layer in model.layers]
    if monkeypatch is not None:
        real = transformer.attention

        def counted(*args, **kwargs):
            calls["core"] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(transformer, "attention", counted)
    tokens, targets = _batch()
    torch.manual_seed(5)  # a forward that draws from torch's RNG starts from the same state
    sample_ids = torch.arange(tokens.shape[0]) if model.hidden_dropout else None
    loss = model.loss(tokens, targets, sample_ids=sample_ids).sum()
    loss.backward()
    for h in hooks:
        h.remove()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, calls["layers"], calls["core"]


def _assert_same_step(got, ref, what):
    assert_same_bits(got[0], ref[0], f"{what}: loss")
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        assert_same_bits(got[1][name], ref[1][name], f"{what}: grad of {name}")


@pytest.mark.parametrize("name,dtype", [("qwen3-tiny", torch.bfloat16), ("mistral-tiny", torch.float32)])
def test_every_setting_gives_the_same_bits(name, dtype, monkeypatch):
    ref = _step(_model(name, dtype), monkeypatch)
    assert (ref[2], ref[3]) == (LAYER_CALLS["none"], CORE_CALLS["none"])
    for key, setting in SETTINGS.items():
        got = _step(_model(name, dtype, setting), monkeypatch)
        _assert_same_step(got, ref, f"{name} {key}")
        assert (got[2], got[3]) == (LAYER_CALLS[key], CORE_CALLS[key]), f"{key}: recompute did not run as set"


def test_hidden_dropout_keeps_its_masks_under_recompute():
    """The keyed dropout masks are a function of (seed, site, sample, token, feature): a recomputed
    layer draws the same masks, so every setting keeps the bits of the dropout run without recompute."""
    ref = _step(_model(hidden_dropout=0.1))
    assert_bits_differ(ref[0], _step(_model())[0], "control: dropout 0.1 changes the loss")
    for key, setting in SETTINGS.items():
        _assert_same_step(_step(_model(recompute=setting, hidden_dropout=0.1)), ref, f"dropout 0.1, {key}")


def test_eval_and_no_grad_forwards_recompute_nothing():
    model = _model(recompute=SETTINGS["full-uniform-1"])
    tokens, _ = _batch()
    ref = _model().eval()(tokens)
    calls = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        assert_same_bits(model(tokens), ref, "no-grad logits with recompute set")
    model.eval()
    out = model(tokens)
    assert_same_bits(out, ref, "eval logits with recompute set")
    out.float().sum().backward()
    assert len(calls) == 2 * LAYERS, "an eval forward was recomputed in backward"


def _perturbed_checkpoint(fn, *args, **kwargs):
    """A recompute whose second run is not the first: its first input scaled by 1 + 2**-4 (the tensors
    the backward reads come from the second run)."""
    runs = []

    def twice(*a, **k):
        runs.append(1)
        i = next(j for j, x in enumerate(a) if isinstance(x, torch.Tensor))
        if len(runs) > 1:
            a = a[:i] + (a[i] * (1 + 2 ** -4),) + a[i + 1:]
        return fn(*a, **k)
    return checkpoint(twice, *args, use_reentrant=False, **kwargs)


@pytest.mark.parametrize("key", ["selective", "full-uniform-1"])
def test_control_a_perturbed_recompute_changes_the_gradients(key, monkeypatch):
    ref = _step(_model())
    monkeypatch.setattr(transformer, "checkpointed", _perturbed_checkpoint)
    got = _step(_model(recompute=SETTINGS[key]))
    assert_same_bits(got[0], ref[0], "loss (the first forward is not perturbed)")
    name = "layers.0.self_attn.q_proj.weight"
    assert_bits_differ(got[1][name], ref[1][name], f"{key} with a perturbed recompute: grad of {name}")


def _torch_rng_dropout(model):
    """Each layer's MLP output through ``F.dropout`` (torch's RNG): the mask is a draw."""
    for layer in model.layers:
        layer.mlp.forward = functools.partial(lambda real, x: F.dropout(real(x), 0.5, True), layer.mlp.forward)
    return model


def test_recompute_restores_torch_rng_and_the_control_without_it_differs(monkeypatch):
    ref = _step(_torch_rng_dropout(_model()))
    assert_bits_differ(ref[1]["layers.0.mlp.down_proj.weight"], _step(_model())[1]["layers.0.mlp.down_proj.weight"],
                       "the torch-RNG dropout is on")
    full = SETTINGS["full-uniform-1"]
    _assert_same_step(_step(_torch_rng_dropout(_model(recompute=full))), ref, "full recompute with torch dropout")
    monkeypatch.setattr(transformer, "checkpointed", functools.partial(checkpoint, use_reentrant=False,
                                                                       preserve_rng_state=False))
    got = _step(_torch_rng_dropout(_model(recompute=full)))
    assert_same_bits(got[0], ref[0], "loss (the first forward draws the same masks)")
    name = "layers.0.mlp.down_proj.weight"
    assert_bits_differ(got[1][name], ref[1][name], f"recompute without RNG restore: grad of {name}")


def _saved_bytes(setting):
    model = _model(recompute=setting)
    tokens, targets = _batch()
    return saved_activation_bytes(lambda: model.loss(tokens, targets), model.parameters())


def test_recompute_lowers_the_bytes_saved_for_backward():
    none, selective = _saved_bytes(None), _saved_bytes(SETTINGS["selective"])
    full1, full2 = _saved_bytes(SETTINGS["full-uniform-1"]), _saved_bytes(SETTINGS["full-uniform-2"])
    block3 = _saved_bytes(SETTINGS["full-block-3"])
    assert full2 < full1 < block3 < selective < none, (none, selective, block3, full1, full2)


def test_settings_follow_megatron():
    assert Recompute(total_layers=4).segments() == [(0, 4, False)]
    assert Recompute("selective", total_layers=4).segments() == [(0, 4, False)]
    assert Recompute("full", "uniform", 2, 4).segments() == [(0, 2, True), (2, 4, True)]
    assert Recompute("full", "block", 1, 4).segments() == [(0, 1, True), (1, 4, False)]
    assert Recompute("full", "block", 4, 4).segments() == [(i, i + 1, True) for i in range(4)]
    bad = [(("full", None, 1), "needs recompute_method"), (("full", "uniform", None), "recompute_num_layers"),
           (("full", "block", 5), "between 1 and"), (("full", "uniform", 3), "does not divide"),
           (("selective", "uniform", None), "must be None"), (("selective", None, 2), "must be None"),
           (("layer", None, None), "recompute_granularity='layer'"), (("full", "every", 1), "recompute_method"),
           ((None, "block", 1), "need recompute_granularity")]
    for (g, m, n), match in bad:
        with pytest.raises(ValueError, match=match):
            Recompute(g, m, n, 4)


def test_flags_and_refusals():
    cfg, _ = parse_configs(["--recompute-granularity", "full", "--recompute-method", "block",
                            "--recompute-num-layers", "1"])
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 1)
    with pytest.raises(SystemExit):
        parse_configs(["--recompute-granularity", "layer"])
    with pytest.raises(NotImplementedError, match="vanilla"):
        TrainConfig(vanilla=True, recompute_granularity="selective").check(1)
    model = _model(recompute=SETTINGS["selective"])
    with pytest.raises(NotImplementedError, match="KV cache"):
        model(_batch()[0], cache=model.new_cache(2, 16))
    with pytest.raises(ValueError, match="recompute_num_layers"):
        train(TrainConfig(model="qwen3-tiny", steps=1, recompute_granularity="full", recompute_method="uniform"))


def test_megatron_dropout_replays_the_masks_of_checkpointed_forwards(monkeypatch):
    import tpinv.megatron.dropout as dropout

    drop = dropout.InvariantDropout(0.5, seed=3, site=4).train()
    x = torch.ones(8, 2, 8)
    phase = ["forward"]
    monkeypatch.setattr(dropout, "_megatron_checkpoint_phase", lambda: phase[0])
    first, second = drop(x), drop(x)  # two micro-batches' checkpointed forwards (1F1B order)
    assert_bits_differ(first, second, "masks of two micro-batches")
    phase[0] = "recompute"
    assert_same_bits(drop(x), first, "recomputed first micro-batch")
    assert_same_bits(drop(x), second, "recomputed second micro-batch")
    with pytest.raises(RuntimeError, match="without a recorded checkpointed forward"):
        drop(x)
    phase[0] = "forward"  # ids given by dropout_sample_ids are recorded and replayed too
    with dropout.dropout_sample_ids(drop, torch.tensor([7, 9])):
        given = drop(x)
    phase[0] = "recompute"
    assert_same_bits(drop(x), given, "recomputed call with given sample ids")
    phase[0] = None
    third = drop(x)  # outside a checkpoint: the next samples
    assert drop.samples == 6 and not any(same_bits(third, t) for t in (first, second, given))


def test_megatron_dropout_under_recompute_needs_is_checkpointing(monkeypatch):
    pytest.importorskip("megatron.core")
    import megatron.core.tensor_parallel.random as mrandom

    import tpinv.megatron.dropout as dropout

    class Model(torch.nn.Module):
        config = type("Config", (), dict(recompute_granularity="full", hidden_dropout=0.1, attention_dropout=0.0))

    dropout._check_recompute_support(Model())
    monkeypatch.delattr(mrandom, "is_checkpointing")
    with pytest.raises(NotImplementedError, match="is_checkpointing"):
        dropout._check_recompute_support(Model())
