"""The C row argmax of greedy sampling against ``torch.argmax``, in every variant this CPU
runs (avx2, avx512: ``isa``): the same index on ties, NaNs, infinities, signed zeros, every
tail length and strided rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import sample_cpu
from pdserve.kernels.cpu_build import variants_here

pytestmark = pytest.mark.skipif(not sample_cpu.available(), reason="no AVX-512 or AVX2 argmax here")


@pytest.fixture(params=variants_here("sample"))
def isa(request) -> str:
    """Each variant of the kernel this CPU runs."""
    return request.param


def _check(x: torch.Tensor, isa: str) -> None:
    assert torch.equal(sample_cpu.argmax(x, isa=isa), x.argmax(dim=-1)), x


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 31, 32, 33, 100, 49152, 49155])
def test_random_rows_of_every_tail_length(n, isa):
    gen = torch.Generator().manual_seed(n)
    _check(torch.randn(9, n, generator=gen), isa)


def test_ties_give_the_first_index(isa):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 200, generator=gen)
    # the max twice, in one lane and across lanes, and in the tail
    x[0, [5, 21]] = 9.0
    x[1, [3, 4, 199]] = 9.0
    x[2, [190, 199]] = 9.0
    x[3, :] = 1.0
    x[4:] = -x[4:].abs() - 1.0
    x[4, 10], x[4, 40] = 0.0, -0.0  # -0 == +0: the first wins either way
    x[5, 10], x[5, 40] = -0.0, 0.0
    _check(x, isa)
    assert sample_cpu.argmax(x, isa=isa).tolist() == [5, 3, 190, 0, 10, 10]


def test_nan_rows_give_their_first_nan(isa):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 70, generator=gen)
    x[0, 3] = float("nan")
    x[1, [69, 20]] = float("nan")
    x[2, 0] = float("nan")
    x[2, 5] = float("inf")
    x[3, :] = float("nan")
    x[4, 66] = float("nan")  # in the tail
    _check(x, isa)
    assert sample_cpu.argmax(x, isa=isa).tolist() == [3, 20, 0, 0, 66]


def test_infinities(isa):
    x = torch.full((4, 40), float("-inf"))
    x[1, 33] = 0.0
    x[2, [7, 30]] = float("inf")
    x[3, 39] = float("-1e30")
    _check(x, isa)
    assert sample_cpu.argmax(x, isa=isa).tolist() == [0, 33, 7, 39]


def test_strided_rows_and_one_row(isa):
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(8, 300, generator=gen)
    _check(wide[:, :250], isa)
    _check(wide[::3, 10:], isa)
    _check(wide[:1], isa)


def test_other_dtypes_and_layouts_fall_back_to_torch(isa):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 50, generator=gen)
    _check(x.to(torch.bfloat16), isa)
    _check(x.t(), isa)
    _check(x.double(), isa)


@pytest.mark.parametrize("n", [3, 45, 203])
def test_the_tail_past_the_last_full_vector(n, isa):
    """Values after the last whole vector of 8 or 16: a max there, a tie with a max before
    it, and the only finite value of a row."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, generator=gen)
    x[0, n - 1] = 9.0
    x[1, [0, n - 1]] = 9.0
    x[2, :] = float("-inf")
    x[2, n - 2] = -5.0
    x[3, :] = float("-inf")
    _check(x, isa)
    assert sample_cpu.argmax(x, isa=isa).tolist() == [n - 1, 0, n - 2, 0]


@pytest.mark.parametrize("n", [31, 32, 33, 100, 49152])
def test_the_token_mask_is_xgrammars(n, isa):
    """Structured outputs' bitmask (xgrammar's layout) as xgrammar's own kernel applies it:
    words of all, none and some tokens, a tail word, and rows left out."""
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=gen)
    words = (n + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=gen, dtype=torch.int32)
    mask[0, ::2] = -1  # every token of the word allowed
    mask[1, ::3] = 0  # none
    rows = [0, 1, 3]
    want = x.clone()
    xgr.apply_token_bitmask_inplace(want, mask, indices=rows)
    got = x.clone()
    assert sample_cpu.apply_bitmask(got, mask, rows, isa=isa)
    assert torch.equal(got, want)
    assert torch.equal(got[[2, 4]], x[[2, 4]])


def test_a_mask_the_kernel_does_not_take_is_left_to_the_caller(isa):
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert not sample_cpu.apply_bitmask(x, torch.zeros(2, 2, dtype=torch.int32), [0], isa=isa)
