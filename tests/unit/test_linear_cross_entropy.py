"""The output layer and cross-entropy in token chunks: the bits of the unchunked path, less memory.

For every chunk size (one token, a non-divisor, the whole batch, more than it) the per-token
loss, the hidden states' gradient and the output weight's gradient are bitwise those of the
column-parallel layer's full logits fed to ``vocab_parallel_cross_entropy``; through the model
(tied and untied output weights) every parameter gradient is.  Negative control: chunking the
weight gradient's token reduction naively (fp32 partials of token chunks added up) gives other
bits, so the equality checks can fail.  Memory: no op of the chunked path makes an output as
large as the full logits, while the unchunked path does.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpinv.layers import linear_cross_entropy, linear_log_probs, vocab_parallel_cross_entropy
from tpinv.layers.functions import ColumnParallelMatmul, column_input_grad
from tpinv.layers.cross_entropy import logits_grad
from tpinv.models import Transformer, get_config
from tpinv.ops import matmul_partial
from tpinv.testing import assert_bits_differ, assert_same_bits, record_ops

T_BATCH, T_SEQ, H, V = 2, 13, 64, 256


def case(dtype, seed=0, vocab=V, hidden=H):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T_BATCH, T_SEQ, hidden, generator=gen)).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.3).to(dtype)
    target = torch.randint(0, vocab, (T_BATCH, T_SEQ), generator=gen)
    seed_grad = torch.rand(T_BATCH, T_SEQ, generator=gen)   # a non-uniform d(loss)
    return x, w, target, seed_grad


def unchunked(x, w, target, seed_grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = ColumnParallelMatmul.apply(x, w, None, None, 8, True)
    loss = vocab_parallel_cross_entropy(logits, target)
    loss.backward(seed_grad)
    return loss.detach(), x.grad, w.grad


def chunked(x, w, target, seed_grad, chunk):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(x, w, target, chunk_tokens=chunk)
    loss.backward(seed_grad)
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [1, 5, 26, 1000])
def test_chunked_loss_and_gradients_equal_unchunked(dtype, chunk):
    x, w, target, seed_grad = case(dtype)
    expected = unchunked(x, w, target, seed_grad)
    got = chunked(x, w, target, seed_grad, chunk)
    for name, a, b in zip(("loss", "dX", "dW"), got, expected):
        assert_same_bits(a, b, f"chunk_tokens={chunk} {dtype}: {name}")


def test_log_probs_are_minus_the_loss():
    x, w, target, _ = case(torch.bfloat16)
    assert_same_bits(linear_log_probs(x, w, target, chunk_tokens=3), -linear_cross_entropy(x, w, target,
                                                                                          chunk_tokens=7), "log-probs")


def test_control_naive_token_chunks_of_the_weight_gradient_differ():
    """dW's token reduction cut into chunks whose fp32 partials are added: another order of
    additions, so other bits (the check above would catch a backward that did this)."""
    x, w, target, seed_grad = case(torch.float32)
    xf, t = x.reshape(-1, H), target.reshape(-1)
    logits = matmul_partial(xf, w, 1)
    lse = torch.logsumexp(logits, -1)   # only dy's bits matter here; both sides use the same dy
    dy = logits_grad(logits, lse, t, seed_grad.reshape(-1))
    naive = sum(matmul_partial(dy[s:s + 4].t(), xf[s:s + 4].t(), 1) for s in range(0, xf.shape[0], 4))
    whole = matmul_partial(dy.t(), xf.t(), 1)
    assert_bits_differ(naive, whole, "dW: token chunks added vs one chain over the tokens")


@pytest.mark.parametrize("name", ["qwen3-tiny", "llama-tiny"])   # tied and separate output weights
def test_model_loss_chunked_equals_unchunked(name):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (2, 11), generator=gen)
    targets = torch.randint(0, 256, (2, 11), generator=gen)
    seed_grad = torch.rand(2, 11, generator=gen)
    runs = {}
    for chunk in (None, 4):
        torch.manual_seed(0)
        model = Transformer(get_config(name, dtype=torch.bfloat16))
        with record_ops() as log:
            loss = model.loss(tokens, targets, chunk_tokens=chunk)
        loss.backward(seed_grad)
        runs[chunk] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, log)
    assert_same_bits(runs[4][0], runs[None][0], f"{name}: loss")
    assert runs[4][1].keys() == runs[None][1].keys()
    for n, g in runs[None][1].items():
        assert_same_bits(runs[4][1][n], g, f"{name}: grad of {n}")
    assert "tpinv::matmul" in runs[4][2] and "tpinv::sum_exp_partial" in runs[4][2]


class _LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_as_large_as_the_logits():
    vocab, hidden, chunk = 1024, 16, 4
    x, w, target, seed_grad = case(torch.bfloat16, vocab=vocab, hidden=hidden)
    tokens = target.numel()
    sizes = {}
    for name, fn in (("chunked", lambda *a: chunked(*a, chunk)), ("unchunked", unchunked)):
        with _LargestOutput() as mode:
            fn(x, w, target, seed_grad)
        sizes[name] = mode.largest
    bound = max(chunk * vocab, vocab * hidden)   # a chunk's logits; the weight and its gradient
    assert sizes["chunked"] <= bound < tokens * vocab, sizes
    assert sizes["unchunked"] >= tokens * vocab, sizes   # control: the full logits exist there


def test_column_input_grad_rows_are_independent():
    """dX row t depends on dY row t only: a chunk of rows gives those rows of the whole."""
    x, w, _, _ = case(torch.bfloat16)
    dy = x.reshape(-1, H)[:, :32].repeat(1, 8)[:, :V].contiguous()
    whole = column_input_grad(dy, w, None, 8)
    assert_same_bits(column_input_grad(dy[3:8], w, None, 8), whole[3:8], "dX rows 3..7")


def test_errors_name_the_setting():
    x, w, target, _ = case(torch.bfloat16)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk_tokens"):
            linear_cross_entropy(x, w, target, chunk_tokens=bad)
    with pytest.raises(ValueError, match="target has shape"):
        linear_cross_entropy(x, w, target[:, :3], chunk_tokens=4)
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(x, w[:, :5], target, chunk_tokens=4)
    model = Transformer(get_config("qwen3-tiny"))
    with pytest.raises(ValueError, match="chunk_tokens"):
        model.loss(target, target, chunk_tokens=0)


def test_trainer_setting_keeps_the_curve_and_weights(monkeypatch):
    import io

    import tpinv.models.transformer as transformer
    from tpinv.training import TrainConfig
    from tpinv.training.loop import Trainer
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["chunk_tokens"])
        return linear_cross_entropy(*args, **kwargs)
    monkeypatch.setattr(transformer, "linear_cross_entropy", counted)
    tiny = dict(model="qwen3-tiny", digits=1, seq_len=6, global_batch=8, micro_batch=4, eval_every=0, warmup=1,
                lr=1e-2, steps=2)
    runs = {}
    for chunk in (None, 5):
        result = Trainer(TrainConfig(**tiny, cross_entropy_chunk_tokens=chunk), stream=io.StringIO()).run()
        runs[chunk] = ([(r["loss_hex"], r["grad_norm_hex"]) for r in result["history"]],
                       result["weights_sha256"])
    assert runs[5] == runs[None]
    assert calls and set(calls) == {5}   # the chunked path ran (in the chunked run only)
    with pytest.raises(ValueError, match="cross_entropy_chunk_tokens"):
        TrainConfig(**tiny, cross_entropy_chunk_tokens=0).check(1)
    with pytest.raises(NotImplementedError, match="cross_entropy_chunk_tokens"):
        TrainConfig(**tiny, cross_entropy_chunk_tokens=4, vanilla=True).check(1)
