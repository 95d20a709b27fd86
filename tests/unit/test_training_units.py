"""Units of tpinv.training and tpinv.core.determinism, in one process (the data: test_training_data.py).

Bitwise (assert_same_bits) for invariance, each beside a negative control that differs; allclose
(stated tolerance) for parity with plain PyTorch.  Checkpoint errors (corrupt, mismatched,
disk full, a crash mid-save) leave the previous checkpoint intact.
"""
from __future__ import annotations

import errno
import io
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tpinv.core import determinism
from tpinv.core.contract import InvarianceError, tree_combine_list
from tpinv.training import (CheckpointError, TrainConfig, Trainer, TreeAccumulator, adamw_update,
                            global_grad_norm, lr_at, read_metrics)
from tpinv.training import train_state as train_ckpt
from tpinv.training.ckpt_files import STATE_FILE
from tpinv.training.loop import fp32_hex
from tpinv.training.model import build_model
from tpinv.training.optim import ParamLayout
from tpinv.testing import assert_bits_differ, assert_same_bits, num_threads
from tpinv.testing.body_tail import body_tail_map

TINY = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=8, micro_batch=4, eval_every=0, warmup=1, lr=1e-2)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models run fastest on one thread (bits do not depend on the thread count)."""
    with num_threads(1):   # tiny ops: a thread pool only adds overhead
        yield


# -- elementwise primitives the optimizer relies on ------------------------------------------------
PRIMITIVES = {
    "sqrt": lambda x: torch.sqrt(x.abs()),
    "div_scalar": lambda x: x / 0.999 ** 3,
    "mul_scalar": lambda x: x * (1.0 - 0.95),
    "div_tensor": lambda x: x / (x.abs() + 1e-8),
    "sub": lambda x: x - x * 0.3,
    "to_bf16": lambda x: x.to(torch.bfloat16),
    "to_fp16": lambda x: x.to(torch.float16),
}


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_elementwise_primitive_is_position_independent(name):
    f = PRIMITIVES[name]
    x = torch.randn(1003) * 3
    whole = f(x)
    assert_same_bits(torch.cat([f(c) for c in x.split(7)]), whole, 'torch.cat([f(c) for c in x.split(7)])')
    assert_same_bits(f(x[::3]), whole[::3], 'f(x[::3])')
    assert_same_bits(torch.cat([f(x[i:i + 1]) for i in range(0, 60)]), whole[:60],
                     'torch.cat([f(x[i:i + 1]) for i in range(0, 60)])')


def _body_tail_exp(x):
    """A kernel whose vector body and scalar tail round differently (written out: every set)."""
    return body_tail_map(lambda t: torch.exp(t * 0.5) * torch.exp(t * 0.5), torch.exp, x)


def test_body_tail_kernel_is_not_position_independent():
    """Negative control of the check above: a kernel with a differing tail fails it."""
    x = torch.randn(4099)
    whole = _body_tail_exp(x)
    assert_bits_differ(torch.cat([_body_tail_exp(x[i:i + 1]) for i in range(x.numel())]), whole, "control")


def _invariant_adamw(p, g, n_steps=3):
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for s in range(n_steps):
        adamw_update(p, g * (s + 1), m, v, step=s + 1, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return p


def _torch_adamw(p, g, n_steps=3, fused=True):
    p = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused)
    for s in range(n_steps):
        p.grad = g * (s + 1)
        opt.step()
    return p.detach()


def _body_fma_adamw(p, g, n_steps=3):
    """The control: :func:`adamw_update` whose first-moment update ``m*b1 + g*(1-b1)`` is one
    fused multiply-add in the vector body and two roundings in the scalar tail."""
    def fused(m, gs):
        return (m.double() * 0.9 + (gs * (1.0 - 0.9)).double()).float()

    def plain(m, gs):
        return m * 0.9 + gs * (1.0 - 0.9)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for s in range(n_steps):
        gs, step = g * (s + 1), s + 1
        m = body_tail_map(fused, plain, m, gs)
        v = v * 0.95 + (gs * gs) * (1.0 - 0.95)
        denom = (v / (1.0 - 0.95 ** step)).sqrt() + 1e-8
        p = p * (1.0 - 1e-2 * 0.1) - (m / (1.0 - 0.9 ** step)) / denom * 1e-2
    return p


def test_adamw_update_same_bits_whole_and_sharded():
    p0, g = torch.randn(1001), torch.randn(1001) * 1e-2
    whole = _invariant_adamw(p0.clone(), g)
    assert_same_bits(torch.cat([_invariant_adamw(a.clone(), b) for a, b in zip(p0.split(7), g.split(7))]), whole, 'result')
    assert_same_bits(torch.cat([_invariant_adamw(p0[i:i + 1].clone(), g[i:i + 1]) for i in range(40)]), whole[:40], 'result')
    # negative control: an AdamW whose vector body fuses the moment update into one multiply-add
    # (as fused optimizer kernels may) gives other bits for 7-element shards
    fused = _body_fma_adamw(p0.clone(), g)
    assert_bits_differ(torch.cat([_body_fma_adamw(a.clone(), b) for a, b in zip(p0.split(7), g.split(7))]),
                       fused, "a body-fused AdamW whole vs in 7-element shards")


def test_adamw_update_parity_with_torch():
    p0, g = torch.randn(513), torch.randn(513) * 1e-2
    ours = _invariant_adamw(p0.clone(), g, n_steps=5)
    ref = _torch_adamw(p0, g, n_steps=5, fused=False)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)  # fp32 tolerance


# -- reductions of the loop ---------------------------------------------------------------------
def _pushed(parts):
    acc = TreeAccumulator()
    for t in parts:
        acc.push(t)
    return acc.result()


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 13))
def test_tree_accumulator_is_the_zero_padded_pair_tree(n):
    # non-zero parts over seven decades (a zero pad turns an exact -0.0 into +0.0; that is not what is tested)
    gen = torch.Generator().manual_seed(n)
    parts = [torch.randn(5, generator=gen) * 10.0 ** torch.randint(-3, 4, (5,), generator=gen) for _ in range(n)]
    assert all(bool((p != 0).all()) for p in parts)
    size = 1 << (n - 1).bit_length()
    padded = parts + [torch.zeros(5)] * (size - n)
    assert_same_bits(_pushed(parts), tree_combine_list(padded), '_pushed(parts)')


def test_tree_accumulator_over_dp_halves_equals_whole():
    """A rank's subtree of its micro-batches, then the tree over ranks == the tree over all."""
    parts = [torch.randn(301) * 1e3 for _ in range(8)]
    halves = [_pushed(parts[:4]), _pushed(parts[4:])]
    assert_same_bits(tree_combine_list(halves), _pushed(parts), 'tree_combine_list(halves)')
    chain = parts[0]
    for t in parts[1:]:
        chain = chain + t
    assert_bits_differ(chain, _pushed(parts), 'chain')  # negative control: the plain chain differs


def test_lr_schedule():
    kw = dict(lr=1.0, min_lr=0.1, warmup=4, total=14)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0 and lr_at(14, **kw) == pytest.approx(0.1) and lr_at(99, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(0.55)


def test_grad_norm_parity_and_single_process_tree():
    _, model = build_model(TrainConfig(**TINY), None, 1, 0)
    layout = ParamLayout(model)
    grads = torch.randn(layout.numel) * torch.rand(layout.numel) ** 4
    norm = global_grad_norm(grads, layout)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(grads), rtol=1e-5, atol=0)  # fp32 tolerance
    assert norm.dtype == torch.float32 and norm.dim() == 0


def test_fp32_hex_round_trips():
    for x in (5.548141002655029, 1.0, 0.0, -2.5, 2.0 ** -130):
        assert float.fromhex(fp32_hex(x)) == x
    assert fp32_hex(1.0) == "0x1p+0"


# -- determinism.enable ---------------------------------------------------------------------------
@pytest.fixture
def restore_global_state(monkeypatch):
    for name in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", *determinism.REFUSED_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    rng = torch.get_rng_state()
    yield monkeypatch
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.set_rng_state(rng)
    for name in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG"):
        os.environ.pop(name, None)


def test_enable_sets_and_is_idempotent(restore_global_state):
    first = determinism.enable(7)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["PYTHONHASHSEED"] == "7"
    assert torch.are_deterministic_algorithms_enabled()
    assert first.torch_flags["cuda.matmul.allow_tf32"] is False
    a = torch.rand(3)
    second = determinism.enable(7)
    assert_same_bits(torch.rand(3), a, 'torch.rand(3)')  # reseeded
    assert second.changed == () and second.env == first.env and second.torch_flags == first.torch_flags


@pytest.mark.parametrize("name,value,cuda", [("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1", False),
                                             ("CUBLAS_WORKSPACE_CONFIG", ":0:0", False),
                                             ("TRITON_INTERPRET", "1", True)])
def test_enable_refuses_settings_that_break_invariance(restore_global_state, name, value, cuda):
    restore_global_state.setenv(name, value)
    restore_global_state.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(InvarianceError, match=name):
        determinism.enable(1)
    assert "PYTHONHASHSEED" not in os.environ  # nothing was changed
    restore_global_state.setenv(name, "0" if name != "CUBLAS_WORKSPACE_CONFIG" else ":16:8")
    determinism.enable(1)  # the safe value is accepted


# -- checkpoints (single process) -------------------------------------------------------------------
def _train(tmp_path, **kw):
    cfg = TrainConfig(**dict(TINY, **kw))
    return Trainer(cfg, stream=io.StringIO()).run()


def _hexes(result):
    return [(r["loss_hex"], r["grad_norm_hex"]) for r in result["history"]]


def test_resume_continues_bitwise_and_errors_keep_previous(tmp_path, monkeypatch):
    full = _train(tmp_path, steps=4)
    ckpt = tmp_path / "ckpt"
    first = _train(tmp_path, steps=4, save=str(ckpt), save_every=2, stop_after=2, log_dir=str(tmp_path / "log"))
    assert _hexes(first) == _hexes(full)[:2]
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    resumed = _train(tmp_path, steps=4, load=str(ckpt))
    assert _hexes(resumed) == _hexes(full)[2:] and resumed["weights_sha256"] == full["weights_sha256"]
    assert resumed["master_sha256"] == full["master_sha256"]
    assert [r["step"] for r in read_metrics(str(tmp_path / "log")) if r["event"] == "step"] == [1, 2]

    trainer = Trainer(TrainConfig(**dict(TINY, steps=4, save=str(ckpt), load=str(ckpt))), stream=io.StringIO())
    trainer.train_step()
    before = sorted(os.listdir(ckpt))

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(train_ckpt, "write_shards", disk_full)
    with pytest.raises(CheckpointError, match="disk full.*step_00000002 is intact"):
        trainer.save()
    assert sorted(os.listdir(ckpt)) == before and (ckpt / "latest").read_text().strip() == "step_00000002"

    def crash(*a, **k):
        raise KeyboardInterrupt  # killed mid-save, after the weights were written
    monkeypatch.setattr(train_ckpt, "write_shards", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    assert sorted(os.listdir(ckpt)) == before
    assert _hexes(_train(tmp_path, steps=4, load=str(ckpt))) == _hexes(full)[2:]  # still loads


def test_corrupt_and_mismatched_checkpoints_are_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    _train(tmp_path, steps=1, save=str(ckpt))
    with pytest.raises(CheckpointError, match="different model: .*family"):
        _train(tmp_path, steps=2, load=str(ckpt), model="llama-tiny")
    with pytest.raises(CheckpointError, match="different model: dtype"):
        _train(tmp_path, steps=2, load=str(ckpt), dtype="fp32")
    _train(tmp_path, steps=2, load=str(ckpt))  # intact: loads
    shard = ckpt / "step_00000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: sha256 mismatch"):
        _train(tmp_path, steps=2, load=str(ckpt))
    state = ckpt / "step_00000001" / STATE_FILE
    old = state.read_text().replace('"format_version": 2', '"format_version": 1')
    state.write_text(old)
    with pytest.raises(CheckpointError, match="format version 1; this tpinv reads version 2"):
        _train(tmp_path, steps=2, load=str(ckpt))
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        _train(tmp_path, steps=2, load=str(tmp_path))
    with pytest.raises(CheckpointError, match="not found"):
        _train(tmp_path, steps=2, load=str(tmp_path / "nothing"))


def test_model_from_hf_directory_and_from_a_checkpoint(tmp_path):
    import transformers
    torch.manual_seed(5)
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=192,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True)
    hf = transformers.Qwen3ForCausalLM(cfg)
    hf.save_pretrained(tmp_path / "hf")
    trainer = Trainer(TrainConfig(**dict(TINY, model=str(tmp_path / "hf"), steps=1, save=str(tmp_path / "ck"))),
                      stream=io.StringIO())
    got = dict(trainer.model.named_parameters())
    for name, p in hf.named_parameters():
        if name != "lm_head.weight":
            assert_same_bits(got[name.removeprefix("model.")], p.detach().to(torch.bfloat16), str(name))
    trainer.run()
    step_dir = str(tmp_path / "ck" / "step_00000001")
    with pytest.raises(ValueError, match="is a training checkpoint.*tools/export_checkpoint.py"):
        Trainer(TrainConfig(**dict(TINY, model=step_dir)), stream=io.StringIO())
    from tpinv.training.export import export_model
    out = export_model(step_dir, str(tmp_path / "exported"))
    again = Trainer(TrainConfig(**dict(TINY, model=out)), stream=io.StringIO())
    assert again.weights_sha256() == trainer.weights_sha256()
    assert again.weights_sha256() != Trainer(TrainConfig(**TINY), stream=io.StringIO()).weights_sha256()  # control


def test_metrics_logger_lines_jsonl_progress_bar_and_plot(tmp_path):
    from tpinv.training.metrics import MetricsLogger, plot_loss_curve
    out = io.StringIO()
    log = MetricsLogger(2, log_dir=str(tmp_path), progress=True, stream=out)
    for step, loss in ((1, 2.5), (2, 1.25)):
        log.step({"step": step, "loss": loss, "loss_hex": fp32_hex(loss), "grad_norm": 1.0, "grad_norm_hex": "0x1p+0",
                  "lr": 1e-3, "tokens_per_s": 10.0, **({"heldout_exact": 0.5, "heldout_token_acc": 0.75}
                                                          if step == 2 else {})})
    log.close()
    text = out.getvalue()
    assert "step 1/2 | loss 2.500000 (0x1.4p+1)" in text and "heldout exact 50.0% token 75.0%" in text
    assert "2/2" in text  # the tqdm bar drew on the stream
    records = read_metrics(str(tmp_path))
    assert [r["loss_hex"] for r in records] == ["0x1.4p+1", "0x1.4p+0"]
    png = plot_loss_curve(records, str(tmp_path / "curve.png"))
    assert os.path.getsize(png) > 1000
    quiet = MetricsLogger(2, enabled=False, stream=out)
    quiet.step(records[0])
    assert out.getvalue() == text  # ranks other than 0 write nothing
