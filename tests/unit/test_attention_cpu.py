"""The CPU C kernels against the torch reference, in every variant this CPU runs (portable,
avx2, avx512: ``isa``): every group size, head dim and block size path (the AVX-512
specialisations, the AVX2 8-lane path, and the portable loops they leave to), fp32 and
bf16, both layouts; and sliding windows against dense attention, with NaN in the blocks
before each window (a kernel that read one would return NaN)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pdserve.kernels import attention_cpu as cpu
from pdserve.kernels import attention_ref as ref
from pdserve.kernels.cpu_build import variants_here
from tests.helpers.sliding_window import (
    dense_paged,
    disjoint_tables,
    first_needed,
    poison_before,
    windows,
)

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")


@pytest.fixture(params=variants_here("attention"))
def isa(request) -> str:
    """Each variant of the kernels this CPU runs."""
    return request.param


def _caches(num_blocks, block_size, hkv, d, dtype, head_major, gen):
    if head_major:  # the engine's layout: [blocks, layers, 2, heads, tokens, dim]
        kv = torch.randn(num_blocks, 3, 2, hkv, block_size, d, generator=gen).to(dtype)
        return kv[:, 1, 0].transpose(1, 2), kv[:, 1, 1].transpose(1, 2)
    kv = torch.randn(num_blocks, 2, 2, block_size, hkv, d, generator=gen).to(dtype)
    return kv[:, 1, 0], kv[:, 1, 1]


def _batch(num_blocks, block_size, lens, gen):
    width = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(perm[start : start + nb] + [0] * (width - nb))
        start += nb
    return torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hkv,group,d,block_size",
    [
        (3, 3, 64, 16),  # SmolLM2
        (2, 4, 32, 16),
        (1, 8, 128, 32),
        (2, 1, 64, 16),
        (2, 9, 64, 16),  # group past the specialised sizes: portable loops
        (2, 2, 24, 16),  # head dim not a multiple of 16
        (2, 3, 64, 8),  # block size not a multiple of 16
        (2, 3, 64, 12),  # nor of 8: portable loops on AVX2
    ],
)
@pytest.mark.parametrize("head_major", [True, False])
def test_decode_matches_the_reference(dtype, hkv, group, d, block_size, head_major, isa):
    gen = torch.Generator().manual_seed(hkv * 100 + group * 10 + d + block_size)
    lens = [1, 15, 16, 17, 33, 200]
    kc, vc = _caches(64, block_size, hkv, d, dtype, head_major, gen)
    tables, seq_lens = _batch(64, block_size, lens, gen)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    scale = 1 / math.sqrt(d)
    want = ref.paged_decode_attention(q, kc, vc, tables, seq_lens, scale)
    got = cpu.paged_decode_attention(q, kc, vc, tables, seq_lens, scale, isa=isa)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,group,d", [(3, 3, 64), (2, 4, 32), (1, 8, 128), (2, 2, 24)])
def test_decode_of_a_large_batch_matches_the_reference(dtype, hkv, group, d, isa):
    """Enough sequences that each thread takes whole sequences (every head of one)."""
    gen = torch.Generator().manual_seed(hkv + group + d)
    lens = [1 + (37 * i) % 150 for i in range(24)] + [0, 300]
    kc, vc = _caches(160, 16, hkv, d, dtype, True, gen)
    tables, seq_lens = _batch(160, 16, [max(n, 1) for n in lens], gen)
    seq_lens[lens.index(0)] = 0
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    scale = 1 / math.sqrt(d)
    got = cpu.paged_decode_attention(q, kc, vc, tables, seq_lens, scale, isa=isa)
    live = seq_lens > 0
    want = ref.paged_decode_attention(q[live], kc, vc, tables[live], seq_lens[live], scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[live], want, atol=tol, rtol=tol)
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,group,d", [(3, 3, 64), (2, 4, 32), (1, 8, 128)])
@pytest.mark.parametrize("window", [0, 41])
def test_a_sequence_gets_the_same_result_alone_and_in_a_large_batch(
    dtype, hkv, group, d, window, isa
):
    """Alone, a sequence's heads are separate tasks; in a large batch, one task takes all of
    them (in the vector variants). The arithmetic of a head is the same in both, bit for
    bit, in a sliding window too: a sequence's output does not depend on the batch it
    decodes in."""
    gen = torch.Generator().manual_seed(11 * hkv + d)
    n = max(16, 4 * torch.get_num_threads())
    lens = [1 + (53 * i) % 200 for i in range(n)]
    kc, vc = _caches(4 + sum(-(-x // 16) for x in lens), 16, hkv, d, dtype, True, gen)
    tables, seq_lens = _batch(kc.shape[0], 16, lens, gen)
    q = torch.randn(n, hkv * group, d, generator=gen).to(dtype)
    together = cpu.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.1, window=window, isa=isa)
    for i in (0, 5, n - 1):
        alone = cpu.paged_decode_attention(
            q[i : i + 1],
            kc,
            vc,
            tables[i : i + 1],
            seq_lens[i : i + 1],
            0.1,
            window=window,
            isa=isa,
        )
        assert torch.equal(alone[0], together[i])


def test_decode_reads_a_strided_query_and_skips_empty_rows(isa):
    gen = torch.Generator().manual_seed(7)
    kc, vc = _caches(16, 16, 2, 64, torch.float32, True, gen)
    tables, seq_lens = _batch(16, 16, [40, 1], gen)
    qkv = torch.randn(3, 6 * 64 + 2 * 128, generator=gen)  # rows of a fused projection
    q = qkv[:, : 6 * 64].view(3, 6, 64)
    tables = torch.cat([tables, tables[:1]])
    seq_lens = torch.tensor([40, 1, 0], dtype=torch.int32)
    got = cpu.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125, isa=isa)
    want = ref.paged_decode_attention(q[:2], kc, vc, tables[:2], seq_lens[:2], 0.125)
    torch.testing.assert_close(got[:2], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2], torch.zeros(6, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fills_slots_and_skips_padding(dtype, isa):
    gen = torch.Generator().manual_seed(3)
    kc, vc = _caches(6, 16, 2, 64, dtype, True, gen)
    before_k, before_v = kc.clone(), vc.clone()
    fused = torch.randn(4, 3, 2, 64, generator=gen).to(dtype)  # k and v interleaved: strided
    k, v = fused[:, 0], fused[:, 1]
    slots = torch.tensor([0, 37, -1, 90])
    cpu.write_kv(k, v, kc, vc, slots, isa=isa)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // 16, s % 16], k[i])
            assert torch.equal(vc[s // 16, s % 16], v[i])
    untouched = torch.ones(6 * 16, dtype=torch.bool)
    untouched[[0, 37, 90]] = False
    assert torch.equal(kc.reshape(-1, 2, 64)[untouched], before_k.reshape(-1, 2, 64)[untouched])
    assert torch.equal(vc.reshape(-1, 2, 64)[untouched], before_v.reshape(-1, 2, 64)[untouched])


def test_prefill_plans_once_per_step_and_anew_for_the_next():
    gen = torch.Generator().manual_seed(7)
    layers = [_caches(24, 16, 3, 64, torch.float32, True, gen) for _ in range(3)]
    plans = []
    for lens, q_lens in [([20, 7, 33], [20, 3, 17]), ([5, 40], [5, 1]), ([5, 40], [5, 2])]:
        bt, seq_lens = _batch(24, 16, lens, gen)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        step = []
        for kc, vc in layers:  # one step: every layer passes the same metadata tensors
            q = torch.randn(sum(q_lens), 9, 64, generator=gen)
            got = cpu.paged_prefill_attention(q, kc, vc, bt, seq_lens, qsl, 0.125)
            want = ref.paged_prefill_attention(q, kc, vc, bt, seq_lens, qsl, 0.125)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            step.append(cpu._plans.by_window[0])
        assert all(p is step[0] for p in step)
        plans.append(step[0])
    assert len({id(p) for p in plans}) == len(plans)  # each step its own plan


def _window_batch(lens, block_size, hkv, d, dtype, gen):
    """Head-major caches and ``disjoint_tables``."""
    num_blocks, tables = disjoint_tables(lens, block_size, gen)
    kc, vc = _caches(num_blocks, block_size, hkv, d, dtype, True, gen)
    return kc, vc, tables


def _decode_in_window(lens, hkv, group, d, block_size, dtype, window, isa):
    """The kernels' decode with NaN before each window, and dense attention without."""
    gen = torch.Generator().manual_seed(window + d + block_size)
    kc, vc, tables = _window_batch(lens, block_size, hkv, d, dtype, gen)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    scale = 1 / math.sqrt(d)
    want = dense_paged(q, kc, vc, tables, lens, [1] * len(lens), scale, window)
    # The kernels read the cache in place from the window's block: the rows before its first
    # token there (in a vector tile's first lanes) must not reach the result either.
    first = first_needed(lens, [1] * len(lens), window)
    assert poison_before((kc, vc), tables, first, rows=True) or window > max(lens)
    bt, seq_lens = torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    got = cpu.paged_decode_attention(q, kc, vc, bt, seq_lens, scale, window=window, isa=isa)
    return got, want


WINDOWS = windows(16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
@pytest.mark.parametrize(
    "hkv,group,d,block_size",
    [
        (3, 3, 64, 16),  # the AVX-512 and AVX2 decoders
        (1, 8, 128, 32),
        (2, 3, 64, 8),  # AVX2's 8-token tiles; portable loops on AVX-512
        (2, 2, 24, 12),  # portable loops everywhere
    ],
)
def test_decode_in_a_window_reads_none_of_the_blocks_before_it(
    dtype, window, hkv, group, d, block_size, isa
):
    """A window's first token anywhere in its block and tile: 1, 15, 17, 40, 77, 200 tokens
    against windows of 1, 9 and 41 tokens (and one past every context)."""
    lens = [1, 15, 17, 40, 77, 200]
    got, want = _decode_in_window(lens, hkv, group, d, block_size, dtype, window, isa)
    assert got.isfinite().all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 9, 41], ids=["w1", "under-a-block", "2.5-blocks"])
def test_decode_of_a_large_batch_in_a_window_reads_none_of_the_blocks_before_it(dtype, window, isa):
    """Enough sequences that each thread takes whole sequences (every head of one)."""
    lens = [1 + (37 * i) % 150 for i in range(max(24, 4 * torch.get_num_threads()))]
    got, want = _decode_in_window(lens, 3, 3, 64, 16, dtype, window, isa)
    assert got.isfinite().all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
def test_chunked_prefill_in_a_window_reads_none_of_the_blocks_before_it(window):
    """The CPU backend's prefill (the reference's plan): chunks from a sequence's start, from
    mid-sequence and of one token, in one call."""
    gen = torch.Generator().manual_seed(window)
    lens, q_lens = [20, 70, 45, 33], [20, 9, 1, 17]
    kc, vc, tables = _window_batch(lens, 16, 2, 64, torch.float32, gen)
    q = torch.randn(sum(q_lens), 6, 64, generator=gen)
    want = dense_paged(q, kc, vc, tables, lens, q_lens, 0.125, window)
    poisoned = poison_before((kc, vc), tables, first_needed(lens, q_lens, window))
    assert poisoned or window > max(lens)
    bt, seq_lens = torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    got = cpu.paged_prefill_attention(q, kc, vc, bt, seq_lens, qsl, 0.125, window=window)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_step_keeps_a_prefill_plan_per_window():
    """Layers of a step that alternate between a window and none (Gemma 3) plan once each."""
    gen = torch.Generator().manual_seed(8)
    kc, vc, tables = _window_batch([20, 40], 16, 3, 64, torch.float32, gen)
    bt, seq_lens = torch.tensor(tables, dtype=torch.int32), torch.tensor([20, 40])
    qsl = torch.tensor([0, 20, 25], dtype=torch.int32)
    plans = []
    for window in (0, 9, 0, 9):
        q = torch.randn(25, 9, 64, generator=gen)
        got = cpu.paged_prefill_attention(q, kc, vc, bt, seq_lens, qsl, 0.125, window=window)
        want = ref.paged_prefill_attention(q, kc, vc, bt, seq_lens, qsl, 0.125, window=window)
        assert torch.equal(got, want)
        plans.append(cpu._plans.by_window[window])
    assert plans[0] is plans[2] and plans[1] is plans[3] and plans[0] is not plans[1]


def test_the_vector_path_is_the_widest_this_cpu_has():
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((ln for ln in lines if ln.startswith("flags")), "").split()
    if "avx512f" in flags:
        assert cpu.vector_path() == "avx512"
    elif "avx2" in flags and "fma" in flags:
        assert cpu.vector_path() == "avx2"
    else:
        assert cpu.vector_path() == "portable"
