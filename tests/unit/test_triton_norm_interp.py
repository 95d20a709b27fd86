"""The RMSNorm kernels' tiles (tpinv.kernels.triton_norm) under Triton's interpreter (CPU).

Bitwise (``assert_same_bits``): with fp32 inputs and a unit weight the forward's output is ``n``
itself, and the weight gradient is exactly the contiguous halving sum over the tokens of
``g * n`` (the first levels inside the backward kernel, the rest over its partials), for token
counts below, at and past a tile's rows; zero-gradient padding tokens leave it unchanged; a
head's row (per-head variant) is a call on that head alone; a row's ``dx`` and ``y`` are the
row's own in any slot of a tile.  Control: an adjacent-pairs token sum differs.  (The
interpreter's ``rsqrt`` and ``tl.sum`` are numpy's: the GPU's bits are checked in
tests/gpu/test_triton_norm_softmax.py.)
"""
from __future__ import annotations

import torch

from tests.unit.triton_interp import checks_of, interpreted_test, main
from tpinv.testing import assert_bits_differ, assert_same_bits


def _norm():
    from tpinv.kernels import triton_norm
    return triton_norm


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def check_weight_gradient_is_the_halving_sum_of_the_forward_n():
    from tpinv.kernels.reference_tree import halving_sum
    tn = _norm()
    for hidden, tokens, heads in [(128, 300, 3), (128, 5, 2), (1000, 37, 1), (64, 1, 3), (256, 64, 2),
                                  (20000, 3, 1)]:
        x, g = _rand(tokens, heads, hidden, seed=hidden), _rand(tokens, heads, hidden, seed=tokens)
        one = torch.ones(hidden)
        n = tn.rms_norm_forward_cuda(x, one, 1e-6)
        dx, per_head = tn.rms_norm_backward_heads_cuda(g, x, one, 1e-6)
        assert_same_bits(per_head, halving_sum((g * n).permute(1, 2, 0)), f"H={hidden} T={tokens}")
        for h in range(heads):
            dx_h, dw_h = tn.rms_norm_backward_cuda(g[:, h].contiguous(), x[:, h].contiguous(), one, 1e-6)
            assert_same_bits(dx[:, h], dx_h, f"dx head {h}")
            assert_same_bits(per_head[h], dw_h, f"dweight head {h}")
        pad = 50
        xp = torch.cat([x, _rand(pad, heads, hidden, seed=7)])
        gp = torch.cat([g, torch.zeros(pad, heads, hidden)])
        dxp, per_head_p = tn.rms_norm_backward_heads_cuda(gp, xp, one, 1e-6)
        assert_same_bits(per_head_p, per_head, "zero-gradient padding tokens")
        assert_same_bits(dxp[:tokens], dx, "dx with padding tokens")
        if tokens >= 4:
            adjacent = (g * n).permute(1, 2, 0)
            adjacent = torch.nn.functional.pad(adjacent, (0, (1 << (tokens - 1).bit_length()) - tokens))
            while adjacent.shape[-1] > 1:
                adjacent = adjacent[..., 0::2] + adjacent[..., 1::2]
            assert_bits_differ(per_head, adjacent[..., 0], "control: adjacent token pairs")


def check_rows_are_their_own_in_any_slot():
    tn = _norm()
    x = _rand(29, 128, seed=1).to(torch.bfloat16)
    g = _rand(29, 128, seed=2).to(torch.bfloat16)
    w = (torch.rand(128, generator=torch.Generator().manual_seed(3)) + 0.5).to(torch.bfloat16)
    y = tn.rms_norm_forward_cuda(x, w, 1e-6)
    dx, _ = tn.rms_norm_backward_cuda(g, x, w, 1e-6)
    for start, stop in [(0, 1), (5, 6), (3, 20), (28, 29)]:
        assert_same_bits(tn.rms_norm_forward_cuda(x[start:stop], w, 1e-6), y[start:stop], f"y {start}:{stop}")
        assert_same_bits(tn.rms_norm_backward_cuda(g[start:stop], x[start:stop], w, 1e-6)[0], dx[start:stop],
                         f"dx {start}:{stop}")


CHECKS = checks_of(dict(globals()))
test_interpreted_kernel = interpreted_test(__file__, CHECKS)

if __name__ == "__main__":
    main(CHECKS)
