"""The AMX bf16 GEMM against fp32 matmul of the same bf16 values, at every row count it serves."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import gemm_cpu

pytestmark = pytest.mark.skipif(not gemm_cpu.available(), reason="this CPU has no AMX")


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (96, 64), (32, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_matmul(n, k, bias):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    packed = gemm_cpu.pack(w)
    # 160 and 448 rows are a block of x at k = 1536 and 576: the row blocks and their tails
    for m in [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 160, 161, 449, 1000]:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        want = x.float() @ w.float().T + (b.float() if bias else 0)
        got = gemm_cpu.linear(x, packed, b, n)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # fp32 accumulation, one bf16 rounding of the result
        torch.testing.assert_close(
            got.float(), want.to(torch.bfloat16).float(), atol=0.1, rtol=1e-2
        )


def test_shapes_it_cannot_tile_are_refused():
    assert not gemm_cpu.supports(torch.zeros(80, 64, dtype=torch.bfloat16))
    assert not gemm_cpu.supports(torch.zeros(64, 48, dtype=torch.bfloat16))
    assert not gemm_cpu.supports(torch.zeros(64, 64))
    with pytest.raises(ValueError, match="no AMX packing"):
        gemm_cpu.pack(torch.zeros(80, 64, dtype=torch.bfloat16))
