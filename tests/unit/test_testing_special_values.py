"""tpinv.testing.special_rows changes only its rows, each to the case it names.

Control: the rows past the 17th, and every row of a copy it returns, are the input's own bytes,
while each special row differs from the input's."""
import pytest
import torch

from tpinv.testing import assert_bits_differ, assert_same_bits, special_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_special_rows_hold_their_cases_and_leave_the_rest(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 64, generator=gen).to(dtype)
    before = x.clone()
    y = special_rows(x)
    assert_same_bits(x, before, "the input is not changed")
    assert_same_bits(y[17:], x[17:], "rows past the cases")
    for r in range(17):
        assert_bits_differ(y[r], x[r], f"row {r}")
    assert torch.isnan(y[0]).sum() == 1 and bool(torch.isneginf(y[1]).all())
    assert bool(torch.isposinf(y[2, -1]))
    negative_nans = (y.view(torch.int32 if dtype == torch.float32 else torch.int16) < 0) & torch.isnan(y)
    assert bool(negative_nans[5].any()) and bool(negative_nans[8].any()) and bool(negative_nans[12, 7])
    assert bool((y[15] == 0).all()) and bool(torch.signbit(y[15]).all())          # -0 alone
    assert bool((y[7] != 0).any()) and bool((y[7].abs() < torch.finfo(dtype).tiny).all())


def test_few_rows_take_the_first_cases_and_bad_input_is_refused():
    x = torch.randn(5, 16)
    y = special_rows(x)
    assert torch.isneginf(y[1]).all() and torch.isinf(y[4]).sum() == 1
    with pytest.raises(ValueError, match="5 rows or more"):
        special_rows(torch.randn(4, 16))
    with pytest.raises(ValueError, match="2-D fp32, bf16 or fp16"):
        special_rows(torch.arange(12).reshape(6, 2))
