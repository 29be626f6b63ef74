"""The torch reference kernels against plain dense attention, on both KV block layouts, with
and without a sliding window (whose out-of-window blocks are never read)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import attention_ref as ref
from tests.helpers.sliding_window import (
    context,
    dense_attention,
    dense_paged,
    disjoint_tables,
    first_needed,
    poison_before,
    windows,
)

BS, HKV, GROUP, D = 4, 2, 3, 8
H = HKV * GROUP


def _caches(num_blocks: int, head_major: bool, gen: torch.Generator):
    if head_major:  # the engine's layout
        kv = torch.randn(num_blocks, 2, 2, HKV, BS, D, generator=gen)
        return kv[:, 1, 0].transpose(1, 2), kv[:, 1, 1].transpose(1, 2)
    kv = torch.randn(num_blocks, 2, 2, BS, HKV, D, generator=gen)
    return kv[:, 1, 0], kv[:, 1, 1]


def _dense(q, k, v, q_pos):
    """q: [Q, H, D] at positions q_pos; k, v: [T, HKV, D]. Causal softmax attention."""
    return dense_attention(q, k, v, q_pos, 1 / math.sqrt(D), 0)


@pytest.mark.parametrize("head_major", [True, False])
def test_decode_and_prefill_match_dense_attention(head_major):
    gen = torch.Generator().manual_seed(0)
    kc, vc = _caches(40, head_major, gen)
    seq_lens = [1, 5, 9, 16]
    q_lens = [1, 3, 9, 4]
    perm = torch.randperm(40, generator=gen).tolist()
    tables, start = [], 0
    for n in seq_lens:
        nb = -(-n // BS)
        tables.append(perm[start : start + nb] + [0] * (4 - nb))
        start += nb
    bt = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    q = torch.randn(len(seq_lens), H, D, generator=gen)
    out = ref.paged_decode_attention(q, kc, vc, bt, lens, 1 / math.sqrt(D))
    for i, n in enumerate(seq_lens):
        k, v = context(kc, tables[i], n), context(vc, tables[i], n)
        want = _dense(q[i : i + 1], k, v, torch.tensor([n - 1]))
        torch.testing.assert_close(out[i : i + 1], want, atol=1e-5, rtol=1e-5)

    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    qp = torch.randn(sum(q_lens), H, D, generator=gen)
    out = ref.paged_prefill_attention(qp, kc, vc, bt, lens, qsl, 1 / math.sqrt(D))
    for i, (n, m) in enumerate(zip(seq_lens, q_lens, strict=True)):
        k, v = context(kc, tables[i], n), context(vc, tables[i], n)
        want = _dense(qp[qsl[i] : qsl[i + 1]], k, v, torch.arange(n - m, n))
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_major", [True, False])
def test_write_kv_fills_the_slots(head_major):
    gen = torch.Generator().manual_seed(1)
    kc, vc = _caches(6, head_major, gen)
    slots = torch.tensor([0, 5, 23, 9])
    k = torch.randn(4, HKV, D, generator=gen)
    ref.write_kv(k, k + 1, kc, vc, slots)
    for i, s in enumerate(slots.tolist()):
        torch.testing.assert_close(kc[s // BS, s % BS], k[i])
        torch.testing.assert_close(vc[s // BS, s % BS], k[i] + 1)


def test_prefill_reads_key_and_value_caches_of_different_layouts():
    gen = torch.Generator().manual_seed(3)
    kc, _ = _caches(12, True, gen)
    _, vc = _caches(12, False, gen)
    bt = torch.tensor([[4, 9, 1], [7, 2, 0]], dtype=torch.int32)
    seq_lens, q_lens = [10, 6], [4, 6]
    qsl = torch.tensor([0, 4, 10], dtype=torch.int32)
    qp = torch.randn(10, H, D, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = ref.paged_prefill_attention(qp, kc, vc, bt, lens, qsl, 1 / math.sqrt(D))
    for i, (n, m) in enumerate(zip(seq_lens, q_lens, strict=True)):
        table = bt[i].tolist()
        k, v = context(kc, table, n), context(vc, table, n)
        want = _dense(qp[qsl[i] : qsl[i + 1]], k, v, torch.arange(n - m, n))
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], want, atol=1e-5, rtol=1e-5)


def _window_batch(seq_lens, head_major, gen):
    """Caches and ``disjoint_tables``."""
    num_blocks, tables = disjoint_tables(seq_lens, BS, gen)
    kc, vc = _caches(num_blocks, head_major, gen)
    return kc, vc, tables


WINDOWS = windows(BS)


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
@pytest.mark.parametrize("head_major", [True, False])
def test_decode_in_a_window_reads_none_of_the_blocks_before_it(head_major, window):
    gen = torch.Generator().manual_seed(window)
    seq_lens = [1, 6, 13, 30]
    kc, vc, tables = _window_batch(seq_lens, head_major, gen)
    q = torch.randn(len(seq_lens), H, D, generator=gen)
    scale = 1 / math.sqrt(D)
    want = dense_paged(q, kc, vc, tables, seq_lens, [1] * len(seq_lens), scale, window)
    poisoned = poison_before((kc, vc), tables, first_needed(seq_lens, [1] * len(seq_lens), window))
    assert poisoned or window > max(seq_lens)
    bt, lens = torch.tensor(tables), torch.tensor(seq_lens, dtype=torch.int32)
    got = ref.paged_decode_attention(q, kc, vc, bt, lens, scale, window=window)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
@pytest.mark.parametrize("head_major", [True, False])
def test_chunked_prefill_in_a_window_reads_none_of_the_blocks_before_it(head_major, window):
    """Chunks from a sequence's start, from mid-sequence (an earlier chunk or a prefix-cache
    hit) and of one token, several sequences of different lengths in one call."""
    gen = torch.Generator().manual_seed(10 + window)
    seq_lens, q_lens = [7, 30, 19, 12], [7, 4, 1, 9]
    kc, vc, tables = _window_batch(seq_lens, head_major, gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), H, D, generator=gen)
    scale = 1 / math.sqrt(D)
    want = dense_paged(q, kc, vc, tables, seq_lens, q_lens, scale, window)
    poisoned = poison_before((kc, vc), tables, first_needed(seq_lens, q_lens, window))
    assert poisoned or window > max(seq_lens)
    bt, lens = torch.tensor(tables), torch.tensor(seq_lens, dtype=torch.int32)
    got = ref.paged_prefill_attention(q, kc, vc, bt, lens, qsl, scale, window=window)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_prefill_plan_is_for_one_window():
    gen = torch.Generator().manual_seed(5)
    kc, _, tables = _window_batch([9, 14], True, gen)
    bt, lens = torch.tensor(tables), torch.tensor([9, 14])
    qsl = torch.tensor([0, 9, 12])
    plan = ref.PrefillPlan(12, kc, bt, lens, qsl, window=3)
    assert plan.matches(12, bt, lens, qsl, None, None, 3)
    assert not plan.matches(12, bt, lens, qsl, None, None, 0)
    assert not plan.matches(12, bt, lens, qsl, None, None)
