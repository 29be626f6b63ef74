"""Packed CPU linears: every row count gives F.linear's result, through oneDNN, the sgemm
kernel (float32, AVX2) or AMX (bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model import ops
from pdserve.engine.model.cpu_linear import (
    AMX_MAX_ROWS,
    PackedLinear,
    describe,
    pack_linears,
    packing_available,
)
from pdserve.kernels import gemm_cpu, sgemm_cpu
from pdserve.kernels.cpu_build import variants_here

pytestmark = pytest.mark.skipif(not packing_available(), reason="needs oneDNN")
BF16 = torch.bfloat16 if packing_available(torch.bfloat16) else None
needs_bf16 = pytest.mark.skipif(BF16 is None, reason="oneDNN has no bf16 path on this CPU")
ROWS = [1, 2, 3, 7, 16, 31, 32, 33, 64, 65, 200, 1024, 1025]


def _take_sgemm(monkeypatch) -> None:
    """float32 linears through the sgemm kernel wherever the CPU runs it (the engine takes
    it by default only on CPUs without AVX-512)."""
    if not variants_here("sgemm"):
        pytest.skip("the sgemm kernel needs AVX2")
    monkeypatch.setattr(sgemm_cpu, "_default_isa", lambda: "avx2")


@pytest.mark.parametrize("use_sgemm", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_f_linear_at_every_row_count(bias, use_sgemm, monkeypatch):
    if use_sgemm:
        _take_sgemm(monkeypatch)
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear, 0, use_amx=True, cpp_op=False, use_sgemm=use_sgemm)
    # AMX is for bfloat16; the sgemm kernel, where taken, is the only copy of the weight.
    assert packed.kernel_name == ("sgemm" if use_sgemm else "")
    assert (packed.onednn is None) == use_sgemm
    for m in ROWS:
        x = torch.randn(m, 96)
        torch.testing.assert_close(
            packed.run(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5
        )


@needs_bf16
@pytest.mark.parametrize("use_amx", [False, True])
def test_bfloat16_matches_f_linear_at_every_row_count(use_amx):
    if use_amx and not gemm_cpu.available():
        pytest.skip("this CPU has no AMX")
    torch.manual_seed(1)
    linear = nn.Linear(128, 96, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear, 0, use_amx=use_amx, cpp_op=False)
    assert (packed.kernel is not None) == use_amx
    for m in ROWS:
        x = torch.randn(m, 128).to(torch.bfloat16)
        want = (x.float() @ linear.weight.float().T + linear.bias.float()).to(torch.bfloat16)
        got = packed.run(x)
        assert got.dtype == torch.bfloat16
        # fp32 accumulation and one rounding either way; the order of the sums differs
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=5e-2)
    assert AMX_MAX_ROWS in ROWS and AMX_MAX_ROWS + 1 in ROWS  # both kernels were used


def test_pack_linears_numbers_them_in_order_and_drops_the_weights():
    second = nn.Linear(64, 32).to(BF16 or torch.float32)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), second)
    packed = pack_linears(model, cpp_op=False)
    assert [p.index for p in packed] == [0, 1]
    assert packed[0] is model[0] and packed[1] is model[2]
    assert [int(p.handle) for p in packed] == [0, 1]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert not hasattr(model[0], "weight")


def test_describe_counts_the_linears_by_the_layouts_they_hold():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 8))
    packed = pack_linears(model, cpp_op=False)
    # 8 output features are not a multiple of 16: that one stays with oneDNN
    want = "3 onednn"
    if sgemm_cpu.available():
        want = "2 sgemm, 1 onednn"
    assert describe(packed) == want
    assert describe([]) == "none"


def test_linears_of_a_dtype_onednn_cannot_pack_stay_plain(monkeypatch):
    from pdserve.engine.model import cpu_linear

    monkeypatch.setattr(cpu_linear, "packing_available", lambda dtype: dtype == torch.float32)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32).to(torch.bfloat16))
    packed = pack_linears(model, cpp_op=False)
    assert [p.in_features for p in packed] == [32]
    assert isinstance(model[1], nn.Linear) and model[1].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(BF16, marks=needs_bf16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("use_sgemm", [False, True])
def test_the_cpp_op_computes_what_the_python_op_does(dtype, bias, use_sgemm, monkeypatch):
    """``pdserve_cpu::linear`` takes the packed weights as inputs and runs the same kernels
    as ``PackedLinear.run``: bit for bit the same result at every row count."""
    if ops.cpu_ops_error() is not None:
        pytest.skip(f"no C++ ops here: {ops.cpu_ops_error()}")
    if use_sgemm:
        _take_sgemm(monkeypatch)
    torch.manual_seed(2)
    linear = nn.Linear(128, 96, bias=bias).to(dtype)
    packed = PackedLinear(linear, 0, use_amx=gemm_cpu.available(), cpp_op=True, use_sgemm=use_sgemm)
    assert (packed.kernel_name == "sgemm") == (use_sgemm and dtype == torch.float32)
    for m in ROWS:
        x = torch.randn(m, 128).to(dtype)
        got = packed(x)
        assert got.dtype == dtype and got.shape == (m, 96)
        assert torch.equal(got, packed.run(x)), m
