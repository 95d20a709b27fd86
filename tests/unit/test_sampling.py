"""Counter-based sampling: the drawn token and its log-probs depend only on the row and its key.

Invariance (bitwise): a row sampled alone, inside a batch at any index, beside other rows or
as a strided view gives the same token and sampled log-prob; so do the counter-based noise
and the fixed-order scan.  Negative controls: a stateful generator (``torch.multinomial``
sharing one ``torch.Generator``) draws a different token for the same row when the row moves
in the batch; the backend's ``torch.cumsum`` adds in another order than the fixed scan.
Parity: the sampled log-prob agrees with a float64 reference of temperature / top-k / top-p.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpinv.engine.sampling import SamplingParams, counter_uniform, prefix_sum, request_key, sample_row, sample_rows
from tpinv.testing import assert_bits_differ, assert_same_bits

V = 256


def logits(n=1, v=V, seed=0, scale=3.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


def strided(t):
    return torch.stack([t, torch.full_like(t, 7.0)], dim=-1)[..., 0]


# ---- counter-based noise --------------------------------------------------------------------------

def test_counter_uniform_is_a_pure_function_of_its_key():
    keys = [(s, r, p) for s in (0, 7) for r in (0, 1, "req-a", "req-b") for p in (0, 1, 1000)]
    first = [counter_uniform(*k) for k in keys]
    again = [counter_uniform(*k) for k in reversed(keys)][::-1]
    assert first == again
    assert len(set(first)) == len(keys)                     # every component changes the number
    assert all(0.0 <= u < 1.0 for u in first)
    assert request_key("req-a") == request_key("req-a") != request_key("req-b")
    with pytest.raises(TypeError, match="int or a str"):
        counter_uniform(0, 1.5, 0)


def test_counter_uniform_is_uniform():
    us = torch.tensor([counter_uniform(3, "r", p) for p in range(4000)])
    counts = torch.histc(us, bins=10, min=0.0, max=1.0)
    chi2 = float(((counts - 400.0) ** 2 / 400.0).sum())
    assert chi2 < 30.0                                       # 9 degrees of freedom; p ~ 4e-4 at 30
    assert abs(float(us.mean()) - 0.5) < 0.02


# ---- the fixed-order scan -------------------------------------------------------------------------

def test_prefix_sum_is_position_independent():
    x = torch.rand(5, 1031, generator=torch.Generator().manual_seed(1))
    full = prefix_sum(x)
    for i in range(5):
        assert_same_bits(prefix_sum(x[i]), full[i], 'prefix_sum(x[i])')
        assert_same_bits(prefix_sum(x[i:i + 1].expand(3, -1))[2], full[i], 'prefix_sum(x[i:i + 1].expand(3, -1))[2]')
    assert_same_bits(prefix_sum(strided(x)), full, 'prefix_sum(strided(x))')
    ints = torch.randint(0, 100, (1031,)).float()             # small integers: every order is exact
    assert_same_bits(prefix_sum(ints), torch.cumsum(ints, 0), 'prefix_sum(ints)')
    # negative control: another order (the backend's sequential cumsum) gives other bits
    assert_bits_differ(torch.cumsum(x, -1), full, 'torch.cumsum(x, -1)')


def test_sort_and_argmax_are_exact_and_position_independent():
    """The only other primitives the sampler relies on: stable sort (ties by id) and argmax (first max)."""
    x = (torch.randint(0, 9, (4, 1031), generator=torch.Generator().manual_seed(2)).float() / 4)  # many ties
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    for i in range(4):
        v1, i1 = torch.sort(x[i], descending=True, stable=True)
        v2, i2 = torch.sort(strided(x)[i], descending=True, stable=True)
        assert_same_bits(v1, values[i], 'v1')
        assert_same_bits(i1, ids[i], 'i1')
        assert_same_bits(i2, ids[i], 'i2')
        ties = ids[i][values[i] == values[i][0]]
        assert_same_bits(ties, torch.sort(ties).values, 'ties')   # equal values stay in token-id order
        assert int(torch.argmax(x[i])) == int(ids[i][0])


# ---- sampling -------------------------------------------------------------------------------------

PARAMS = [SamplingParams(1.0, seed=1), SamplingParams(0.7, top_k=20, seed=2), SamplingParams(1.3, top_p=0.8, seed=3),
          SamplingParams(0.6, top_k=20, top_p=0.95, seed=42), SamplingParams(0.0)]


@pytest.mark.parametrize("params", PARAMS)
def test_row_gives_the_same_draw_anywhere_in_a_batch(params):
    rows = logits(7, seed=3)
    ids = [f"r{i}" for i in range(7)]
    alone = [sample_row(rows[i], params, ids[i], 11) for i in range(7)]
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(4)).tolist()
    shuffled = sample_rows(rows[perm], [params] * 7, [ids[p] for p in perm], [11] * 7)
    for j, p in enumerate(perm):
        assert shuffled[j] == alone[p]
    assert sample_row(strided(rows)[2], params, ids[2], 11) == alone[2]
    assert sample_row(rows[2].to(torch.float32).clone(), params, ids[2], 11) == alone[2]


def test_negative_control_stateful_generator_depends_on_batch_position():
    rows = logits(7, seed=3)
    probs = torch.softmax(rows, -1)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(4)).tolist()
    alone = [int(torch.multinomial(probs[i], 1, generator=torch.Generator().manual_seed(0))) for i in range(7)]
    batched = torch.multinomial(probs[perm], 1, generator=torch.Generator().manual_seed(0))[:, 0].tolist()
    assert any(batched[j] != alone[p] for j, p in enumerate(perm))
    ours = [sample_row(rows[i], PARAMS[0], i, 0).token for i in range(7)]
    assert [sample_row(rows[p], PARAMS[0], p, 0).token for p in perm] == [ours[p] for p in perm]


@settings(max_examples=12, deadline=None)
@given(v_leaves=st.integers(1, 40), batch=st.integers(1, 6), index=st.integers(0, 5), k=st.integers(0, 30),
       p=st.floats(0.05, 1.0), t=st.floats(0.0, 2.0), seed=st.integers(0, 2**31))
def test_draw_is_independent_of_batch_shape(v_leaves, batch, index, k, p, t, seed):
    v = 8 * v_leaves
    params = SamplingParams(t, top_k=k, top_p=p, seed=seed)
    rows = logits(batch, v, seed=seed % 1000)
    i = index % batch
    alone = sample_row(rows[i].clone(), params, "q", 5)
    assert sample_rows(rows, [params] * batch, ["q"] * batch, [5] * batch)[i] == alone
    assert 0 <= alone.token < v


def reference(row, params):
    """float64 tempered, filtered distribution q (the parity reference)."""
    z = row.double() / params.temperature
    p = torch.softmax(z, -1)
    order = torch.sort(p, descending=True, stable=True).indices
    keep = torch.zeros_like(p, dtype=torch.bool)
    n = row.numel() if params.top_k == 0 else min(params.top_k, row.numel())
    mass = float(p[order[:n]].sum())                        # top-p runs on the renormalized top-k survivors
    cum = 0.0
    for tok in order.tolist()[:n]:
        if cum >= params.top_p * mass:
            break
        keep[tok] = True
        cum += float(p[tok])
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


@pytest.mark.parametrize("params", PARAMS[:4])
def test_sampled_log_prob_matches_the_filtered_distribution(params):
    row = logits(1, seed=9)[0]
    q = reference(row, params)
    tokens = []
    for rid in range(300):
        out = sample_row(row, params, rid, 3)
        assert q[out.token] > 0, "drew a token the filters remove"
        assert math.isclose(out.sampled_log_prob, math.log(float(q[out.token])), rel_tol=1e-5, abs_tol=1e-5)
        tokens.append(out.token)
    freq = torch.bincount(torch.tensor(tokens), minlength=V).double() / len(tokens)
    top = torch.argsort(q, descending=True)[:3]
    assert float((freq[top] - q[top]).abs().max()) < 0.09      # the draws follow q (300 draws)


def test_no_filter_log_prob_is_the_tempered_log_softmax_exactly():
    from tpinv.layers import vocab_parallel_log_probs
    from tpinv.ops import logsumexp
    row = logits(1, seed=5)[0]
    out = sample_row(row, SamplingParams(0.8, seed=1), "a", 0)
    z = row / 0.8
    assert out.sampled_log_prob == float(z[out.token] - logsumexp(z, 8))
    # at temperature 1 it is the training cross-entropy's log-prob, bit for bit
    out = sample_row(row, SamplingParams(1.0, seed=1), "a", 0)
    assert out.sampled_log_prob == float(vocab_parallel_log_probs(row[None], torch.tensor([out.token]))[0])


def test_greedy_takes_the_first_maximum_and_reports_a_point_mass():
    row = torch.zeros(V)
    row[[17, 40, 200]] = 5.0
    out = sample_row(row, SamplingParams(0.0), "g", 0)
    assert out.token == 17 and out.sampled_log_prob == 0.0
    assert sample_row(row, SamplingParams(1.0, top_k=1), "g", 0).token == 17   # top_k=1 is greedy as well
    assert sample_row(row, SamplingParams(1e-7), "g", 0) == out                # logits / 1e-7 would overflow


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(seed="x"), "seed")])
def test_invalid_params_raise_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad).validate()


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"shape \[V\]"):
        sample_row(logits(2), SamplingParams(), 0, 0)
    with pytest.raises(ValueError, match=r"\[n, V\]"):
        sample_rows(logits(2), [SamplingParams()], [0], [0])
