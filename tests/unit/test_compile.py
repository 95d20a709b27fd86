"""torch.compile on tpinv layers, models and the engine's decode: full graph, the eager bits.

``tpinv.compile`` (inductor, ``emulate_precision_casts=True``, ``fullgraph=True``) is compared
with eager byte for byte, forward and backward, at TP=1.  Controls, beside the claims:

* plain ``torch.compile`` of a bf16 chain differs from eager by construction: inductor fuses
  ``(x + 2**-9) - x`` in fp32 and rounds once (``2**-9``) where eager rounds after each op (``0``),
  whatever the machine -- the comparison catches a compile that skips a rounding;
* eager raises ``IndexError`` naming the id, the compiled graph ``RuntimeError`` from its
  ``_assert_async`` node (``docs/compile.md``): the check is not dropped.

Inductor compiles C++ on the CPU (tens of seconds a graph): the model and engine tests are slow.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import tpinv
from tpinv.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy
from tpinv.models.configs import get_config
from tpinv.models.transformer import LayerConfig, Transformer
from tpinv.core.compile import COMPILE_TORCH_FLOOR, check_compile_torch
from tpinv.core.versions import torch_at_least
from tpinv.testing import assert_bits_differ, assert_same_bits

_OLD_TORCH = not torch_at_least(COMPILE_TORCH_FLOOR)
needs_compile_torch = pytest.mark.skipif(_OLD_TORCH, reason=f"tpinv.compile needs torch >= {COMPILE_TORCH_FLOOR} "
                                         f"(refused below it: test_compile_refuses_an_older_torch)")


def test_compile_refuses_an_older_torch():
    with pytest.raises(NotImplementedError, match=r"tpinv.compile needs torch >= 2\.13.*torch 2\.6\.0\+cu124 is installed"):
        check_compile_torch("2.6.0+cu124")
    check_compile_torch("2.13.0+cpu")  # control: the tested release passes
    check_compile_torch("2.15.0")
    if _OLD_TORCH:
        with pytest.raises(NotImplementedError, match="tpinv.compile needs torch"):
            tpinv.compile(torch.nn.Linear(2, 2))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _init(t):
    torch.nn.init.normal_(t, std=0.5)


class _Layers(torch.nn.Module):
    """Embedding -> column -> row -> vocab cross-entropy: every TP layer, fwd and bwd."""

    def __init__(self, dtype):
        super().__init__()
        config = LayerConfig(params_dtype=dtype, tpinv_leaves=8, tpinv_row_strategy="tree")
        self.embed = VocabParallelEmbedding(64, 32, init_method=_init, config=config)
        self.column = ColumnParallelLinear(32, 64, config=config, init_method=_init, bias=True)
        self.row = RowParallelLinear(64, 64, config=config, init_method=_init, bias=False, input_is_parallel=True,
                                     skip_bias_add=False)

    def forward(self, ids, targets):
        h = self.embed(ids)
        logits = self.row(self.column(h)[0])[0] + h.repeat(1, 1, 2)   # a bf16 residual add
        return logits, vocab_parallel_cross_entropy(logits, targets)


def _run(fn, module, *inputs):
    module.zero_grad(set_to_none=True)
    out, loss = fn(*inputs)
    loss.sum().backward()
    return [out.detach(), loss.detach()] + [p.grad for _, p in sorted(module.named_parameters())]


def _assert_all_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_bits(g, w, f"{what}, output {i}")


def _layer_inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (2, 7), generator=gen), torch.randint(0, 64, (2, 7), generator=gen)


@needs_compile_torch
def test_helper_refuses_settings_that_change_bits():
    with pytest.raises(ValueError, match="emulate_precision_casts"):
        tpinv.compile(torch.nn.Linear(2, 2), options={"emulate_precision_casts": False})
    with pytest.raises(ValueError, match="backend='cudagraphs'"):
        tpinv.compile(torch.nn.Linear(2, 2), backend="cudagraphs")
    with pytest.raises(ValueError, match="inductor options"):
        tpinv.compile(torch.nn.Linear(2, 2), backend="aot_eager", options={"max_autotune": True})


@needs_compile_torch
def test_layers_bf16_compiled_equal_eager_and_a_fused_bf16_chain_differs():
    torch.manual_seed(0)
    layers = _Layers(torch.bfloat16)
    inputs = _layer_inputs()
    eager = _run(layers, layers, *inputs)
    before = _graphs()
    compiled = _run(tpinv.compile(layers), layers, *inputs)
    assert _graphs() > before, "nothing was compiled"
    _assert_all_same(compiled, eager, "tpinv.compile(bf16 layers)")
    # Control: a compile that fuses bf16 ops and rounds once is caught by the same comparison. By
    # construction: in bf16 1 + 2**-9 rounds to 1, so (x + 2**-9) - x is 0 when each op rounds (eager);
    # plain inductor computes the fused pair in fp32 and stores 2**-9.
    def glue(x):
        return (x + 2 ** -9) - x

    ones = torch.ones(4, 8, dtype=torch.bfloat16)
    assert_bits_differ(torch.compile(glue, fullgraph=True)(ones), glue(ones),
                       "plain torch.compile of a bf16 chain (fused in fp32, rounded once)")


@needs_compile_torch
@pytest.mark.slow
def test_layers_fp32_plain_compile_equal_eager():
    """fp32 has no narrowing cast to fuse: plain torch.compile keeps the eager bits too."""
    torch.manual_seed(0)
    layers = _Layers(torch.float32)
    inputs = _layer_inputs()
    eager = _run(layers, layers, *inputs)
    _assert_all_same(_run(torch.compile(layers, fullgraph=True), layers, *inputs), eager, "torch.compile(fp32)")


@needs_compile_torch
def test_token_id_check_runs_inside_the_compiled_graph():
    torch.manual_seed(0)
    config = LayerConfig(params_dtype=torch.float32, tpinv_leaves=8, tpinv_row_strategy="tree")
    embed = VocabParallelEmbedding(64, 8, init_method=_init, config=config)
    compiled = tpinv.compile(embed)
    ids = torch.tensor([[1, 63, 0]])
    assert_same_bits(compiled(ids), embed(ids), "compiled lookup")
    bad = torch.tensor([[1, 64, 0]])
    with pytest.raises(IndexError, match="token id 64 is outside the vocabulary"):
        embed(bad)
    with pytest.raises(RuntimeError, match=r"token id outside \[0, 64\)"):
        compiled(bad)
    with pytest.raises(RuntimeError, match=r"token id outside \[0, 64\)"):
        compiled(torch.tensor([[-1, 0, 0]]))


@needs_compile_torch
def test_cache_position_check_runs_inside_the_compiled_graph():
    from tpinv.models.kv_cache import KVCache
    cache = KVCache(2, 8, 1, 1, 4, dtype=torch.float32)

    def advance(positions):
        cache.advance(positions)
        return cache.lengths + 0

    compiled = tpinv.compile(advance)
    compiled(torch.tensor([[3], [7]]))
    assert cache.lengths.tolist() == [4, 8]
    with pytest.raises(ValueError, match=r"positions must lie in \[0, max_len=8\)"):
        advance(torch.tensor([[8], [0]]))
    with pytest.raises(RuntimeError, match=r"cache position outside \[0, 8\)"):
        compiled(torch.tensor([[8], [0]]))
    assert cache.lengths.tolist() == [4, 8]


@pytest.mark.slow
@pytest.mark.parametrize("name,explicit_positions", [
    ("qwen3-tiny", False), ("llama-tiny", True), ("mistral-tiny", False)])
@needs_compile_torch
def test_model_compiled_equal_eager_forward_and_backward(name, explicit_positions):
    """Logits, per-token losses and every parameter gradient of a bf16 model.  With explicit
    positions the compiled model takes the packed attention path (it cannot branch on their
    values), whose bits for ``arange`` positions are the unpacked ones."""
    torch.manual_seed(0)
    model = Transformer(get_config(name, dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 256, (2, 9), generator=gen), torch.randint(0, 256, (2, 9), generator=gen)
    positions = torch.arange(9).expand(2, 9).contiguous() if explicit_positions else None

    def step(tokens, targets, positions):
        logits = model(tokens, positions)
        return logits, vocab_parallel_cross_entropy(logits, targets)

    eager = _run(step, model, tokens, targets, positions)
    before = _graphs()
    compiled = _run(tpinv.compile(step), model, tokens, targets, positions)
    assert _graphs() > before
    _assert_all_same(compiled, eager, f"tpinv.compile({name})")


@needs_compile_torch
@pytest.mark.slow
def test_engine_compiled_decode_equals_eager():
    from tpinv.engine import Engine
    from tpinv.engine.scheduler import Request

    torch.manual_seed(0)
    model = Transformer(get_config("qwen3-tiny", dtype=torch.bfloat16))

    def requests():
        return [Request("a", [1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True, top_logprobs=3),
                Request("b", [7, 8], max_tokens=5, ignore_eos=True)]

    eager = Engine(model, max_batch=2, max_context=16).generate(requests())
    engine = Engine(model, max_batch=2, max_context=16, compile=True)
    before = _graphs()
    compiled = engine.generate(requests())
    assert _graphs() > before and engine.compiled_decodes > 0
    for e, c in zip(eager, compiled):
        assert c.token_ids == e.token_ids
        assert_same_bits(c.logprobs, e.logprobs, f"{e.request_id}: raw log-probs")
        assert_same_bits(c.sampled_logprobs, e.sampled_logprobs, f"{e.request_id}: sampled log-probs")
    assert_same_bits(compiled[0].top_logprobs, eager[0].top_logprobs, "top log-probs")
    with pytest.raises(ValueError, match="compile=True cannot be combined with vanilla=True"):
        Engine(model, max_batch=2, max_context=16, compile=True, vanilla=True)


def test_forced_cpu_kernel_set_names_the_vector_length(monkeypatch):
    from tpinv.core.compile import forced_simdlen
    for cap, simdlen in (("avx2", 256), ("AVX512", 512), ("default", 1), ("", None)):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
        assert forced_simdlen() == simdlen, cap
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert forced_simdlen() is None
