"""``pdserve_cpu::attention`` (the C++ op of a compiled CPU step) against the Python op it
replaces: the same KV writes and the same attention output, for decode-only steps (the C
kernel in place), mixed steps (the prefill rows through ``pdserve::prefill_attention``)
and padded decode rows, with and without a sliding window; and a clear error outside a
step."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata, PagedAttention
from pdserve.engine.forward_context import ForwardContext, forward_context
from pdserve.engine.model import ops
from pdserve.kernels import attention_cpu

pytestmark = pytest.mark.skipif(
    ops.cpu_ops_error() is not None, reason=f"no C++ ops here: {ops.cpu_ops_error()}"
)

LAYERS, HKV, GROUP, D, BS, BLOCKS = 3, 2, 3, 64, 16, 40


def _step(decode_lens, prefill, gen):
    """Metadata of a step: decode rows (context lengths incl. the new token; 0 = padding),
    then prefill chunks given as (cached, new) token counts."""
    perm = iter(torch.randperm(BLOCKS, generator=gen).tolist())
    width = 8
    tables, slots, lens = [], [], []
    for n in decode_lens:
        nb = -(-n // BS)
        t = [next(perm) for _ in range(nb)] + [0] * (width - nb)
        tables.append(t)
        lens.append(n)
        slots.append(t[(n - 1) // BS] * BS + (n - 1) % BS if n else -1)
    p_tables, p_lens, qsl = [], [], [0]
    for cached, new in prefill:
        end = cached + new
        nb = -(-end // BS)
        t = [next(perm) for _ in range(nb)] + [0] * (width - nb)
        p_tables.append(t)
        p_lens.append(end)
        qsl.append(qsl[-1] + new)
        slots += [t[p // BS] * BS + p % BS for p in range(cached, end)]
    nd = len(decode_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_decode_tokens=nd
    )
    if nd:
        meta.decode_block_tables = torch.tensor(tables, dtype=torch.int32)
        meta.decode_seq_lens = torch.tensor(lens, dtype=torch.int32)
        meta.decode_max_seq_len = max(lens)
    if prefill:
        meta.prefill_block_tables = torch.tensor(p_tables, dtype=torch.int32)
        meta.prefill_seq_lens = torch.tensor(p_lens, dtype=torch.int32)
        meta.prefill_query_start_loc = torch.tensor(qsl, dtype=torch.int32)
        meta.prefill_max_query_len = max(new for _, new in prefill)
        meta.prefill_max_seq_len = max(p_lens)
    return meta


def _both(meta, dtype, layer=1, window=0):
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(BLOCKS, LAYERS, 2, HKV, BS, D, generator=gen).to(dtype)
    caches = [(kv[:, i, 0].transpose(1, 2), kv[:, i, 1].transpose(1, 2)) for i in range(LAYERS)]
    n = meta.slot_mapping.shape[0]
    q = torch.randn(n, HKV * GROUP, D, generator=gen).to(dtype)
    k = torch.randn(n, HKV, D, generator=gen).to(dtype)
    v = torch.randn(n, HKV, D, generator=gen).to(dtype)
    scale = 1 / math.sqrt(D)
    attn = PagedAttention(attention_cpu, "cpu")
    ctx = ForwardContext(attn, caches, meta)
    kv_py = kv.clone()
    caches_py = [
        (kv_py[:, i, 0].transpose(1, 2), kv_py[:, i, 1].transpose(1, 2)) for i in range(LAYERS)
    ]
    want = attn(q, k, v, *caches_py[layer], meta, scale, window)
    with forward_context(ctx), ops.cpu_step(kv, meta):
        got = torch.ops.pdserve_cpu.attention(q, k, v, layer, scale, window)
    return got, want, kv, kv_py


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "decode_lens, prefill",
    [
        ([1, 17, 33, 100], []),  # decode only
        ([5, 0, 0], []),  # padded to a bucket
        ([9, 64], [(0, 20), (16, 7)]),  # mixed
        ([], [(0, 30)]),  # prefill only
    ],
)
def test_the_cpp_op_matches_the_python_op(dtype, decode_lens, prefill, window):
    """The window reaches the decode kernel and the prefill rows' Python op alike."""
    meta = _step(decode_lens, prefill, torch.Generator().manual_seed(len(decode_lens)))
    got, want, kv, kv_py = _both(meta, dtype, window=window)
    assert got.dtype == dtype
    assert torch.equal(kv, kv_py)  # the same slots written, nothing else
    assert torch.equal(got, want)
    nd = len(decode_lens)
    for row, n in enumerate(decode_lens):
        if n == 0:
            assert not got[row].any()  # a padding row attends to nothing
    assert got.shape[0] == nd + sum(new for _, new in prefill)


def test_outside_a_step_is_an_error():
    q = torch.zeros(1, HKV * GROUP, D)
    k = torch.zeros(1, HKV, D)
    with pytest.raises(RuntimeError, match="outside a step"):
        torch.ops.pdserve_cpu.attention(q, k, k, 0, 1.0, 0)


def test_a_step_of_another_size_is_an_error():
    meta = _step([3, 4], [], torch.Generator().manual_seed(0))
    kv = torch.zeros(BLOCKS, LAYERS, 2, HKV, BS, D)
    q = torch.zeros(3, HKV * GROUP, D)
    k = torch.zeros(3, HKV, D)
    with ops.cpu_step(kv, meta), pytest.raises(RuntimeError, match="the step has 2 tokens"):
        torch.ops.pdserve_cpu.attention(q, k, k, 0, 1.0, 0)
