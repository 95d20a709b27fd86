"""The mismatch corrections against hand-computed values, and the identity on the invariant path."""
from __future__ import annotations

import math

import pytest
import torch

from tpinv.rl import mismatch as mm
from tpinv.testing import assert_bits_differ, assert_same_bits

LN2 = math.log(2.0)
ROLL = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
TRAIN = ROLL + torch.tensor([[LN2, -LN2, 0.0], [2 * LN2, 0.0, 5.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_token_sequence_geometric_weights():
    tok = mm.importance_weights(TRAIN, ROLL, MASK, "token")
    torch.testing.assert_close(tok, torch.tensor([[2.0, 0.5, 1.0], [4.0, 1.0, 0.0]]))
    seq = mm.importance_weights(TRAIN, ROLL, MASK, "sequence")  # products 2*0.5*1 and 4*1
    torch.testing.assert_close(seq, torch.tensor([[1.0, 1.0, 1.0], [4.0, 4.0, 0.0]]))
    geo = mm.importance_weights(TRAIN, ROLL, MASK, "geometric")  # (1)^(1/3), 4^(1/2)
    torch.testing.assert_close(geo, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))


def test_truncate_clip_reject_veto_normalize():
    w = torch.tensor([[2.0, 0.5, 1.0], [4.0, 1.0, 0.0]])
    torch.testing.assert_close(mm.truncate(w, 1.5), torch.tensor([[1.5, 0.5, 1.0], [1.5, 1.0, 0.0]]))
    torch.testing.assert_close(mm.clip(w, 0.8, 3.0), torch.tensor([[2.0, 0.8, 1.0], [3.0, 1.0, 0.8]]))
    assert mm.reject(w, MASK, 0.8, 3.0).tolist() == [[True, False, True], [False, True, False]]
    assert mm.reject(w, MASK, 0.8, 3.0, whole_sequence=True).tolist() == [[False] * 3, [False] * 3]
    lp = torch.tensor([[-1.0, -20.0, -1.0], [-1.0, -2.0, -30.0]])  # p(-20) < 1e-6; -30 is masked out
    assert mm.veto(lp, MASK, 1e-6).tolist() == [[False] * 3, [True, True, False]]
    # valid weights 2, .5, 1, 4, 1 -> mean 1.7
    torch.testing.assert_close(mm.batch_normalize(w, MASK),
                               torch.tensor([[2 / 1.7, 0.5 / 1.7, 1 / 1.7], [4 / 1.7, 1 / 1.7, 0.0]]))
    w2, m2 = mm.correct(TRAIN, ROLL, MASK, mode="mask", lower=0.8, upper=3.0)
    assert m2.tolist() == [[True, False, True], [False, True, False]]
    torch.testing.assert_close(w2, torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="level='tok'"):
        mm.importance_weights(TRAIN, ROLL, MASK, "tok")


@pytest.mark.parametrize("level", mm.LEVELS)
@pytest.mark.parametrize("mode", ["truncate", "clip", "mask", None])
def test_invariant_path_makes_every_correction_the_identity(level, mode):
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 9, generator=gen) * 5
    mask = torch.rand(4, 9, generator=gen) > 0.2
    w, m = mm.correct(lp, lp.clone(), mask, level=level, mode=mode, lower=0.999, upper=1.001,
                      veto_threshold=1e-9, normalize=True)
    assert_same_bits(w, mask.float(), f"{level}/{mode} weights on equal log-probs")
    assert_same_bits(m, mask, f"{level}/{mode} mask on equal log-probs")
    # Control: one ulp of mismatch in one token already moves the weights off exactly 1.
    off = lp.clone()
    off[0, 0] = torch.nextafter(off[0, 0], torch.tensor(0.0))
    w_off = mm.importance_weights(lp, off, mask | torch.eye(4, 9, dtype=torch.bool), level)
    assert_bits_differ(w_off, (mask | torch.eye(4, 9, dtype=torch.bool)).float(), "one-ulp mismatch")
