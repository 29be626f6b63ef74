"""MKL-packed linears: every batch size gives F.linear's result, through its bucket."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.engine.model.cpu_packing import (
    PackedLinear,
    buckets_for,
    mkl_packing_available,
    pack_linears,
)

pytestmark = pytest.mark.skipif(not mkl_packing_available(), reason="needs MKL")


def test_buckets_stop_at_max_num_seqs():
    assert buckets_for(64) == (8, 16, 32, 64)
    assert buckets_for(20) == (8, 16, 20)
    assert buckets_for(4) == (4,)
    assert buckets_for(256) == (8, 16, 32, 64, 256)


def test_every_row_count_matches_f_linear():
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=True)
    packed = PackedLinear(linear, buckets_for(64))
    for m in [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 200]:
        x = torch.randn(m, 96)
        got = packed(x)
        assert got.shape == (m, 160)
        torch.testing.assert_close(
            got, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5
        )


def test_pack_linears_replaces_float32_linears_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.ReLU())
    assert pack_linears(model, (8,)) == 1
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], nn.Linear)
