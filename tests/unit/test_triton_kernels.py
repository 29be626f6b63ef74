"""Triton paged-attention kernels against their torch references: compiled on a CUDA
machine, under Triton's interpreter elsewhere (``TRITON_INTERPRET=1`` forces it there too).

TRITON_INTERPRET must be set before triton is first imported in the process (tests/conftest.py
sets it on machines without CUDA). Shapes are small: the interpreter costs milliseconds per
loop iteration per program.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import pdserve.kernels  # noqa: E402
from pdserve.kernels import attention_ref as ref  # noqa: E402
from pdserve.kernels import triton_attention as tk  # noqa: E402
from pdserve.kernels import triton_decode  # noqa: E402
from tests.helpers.sliding_window import (  # noqa: E402
    dense_paged,
    disjoint_tables,
    first_needed,
    poison_before,
    windows,
)

_INTERPRETED = type(triton_decode._decode_split_kernel).__name__ == "InterpretedFunction"
if _INTERPRETED:
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set and there is no GPU",
        allow_module_level=True,
    )

# Kernel output against the fp32 reference on the same (rounded) inputs. bf16 is loose:
# P is rounded to bf16 before the PV product, and the interpreter truncates on casts.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2.5e-2, "rtol": 2e-2},
}
NUM_LAYERS = 3  # the cache views are layer 1 of a [blocks, layers, 2, ...] buffer
GARBAGE_BLOCK = 2**30  # block-table padding no kernel may read


def _cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, gen
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided per-layer K/V views, as the engine passes them.

    The engine stores blocks head-major, [blocks, layers, 2, kv_heads, block_size, head_dim],
    and hands kernels kv[:, layer, 0].transpose(1, 2): [blocks, block_size, kv_heads, head_dim].
    """
    shape = (num_blocks, NUM_LAYERS, 2, num_kv_heads, block_size, head_dim)
    kv = torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE)
    return kv[:, 1, 0].transpose(1, 2), kv[:, 1, 1].transpose(1, 2)


def _block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, index_dtype, gen
) -> torch.Tensor:
    """Shuffled, non-overlapping block ids per sequence, padded as an engine might.

    Columns that the reference gathers for the longest sequence hold random valid ids
    past a shorter sequence's end; columns past that hold garbage ids.
    """
    needed = [-(-n // block_size) for n in seq_lens]
    width = max(needed)
    perm = torch.randperm(num_blocks, generator=gen)
    assert sum(needed) <= num_blocks, "test bug: too few blocks"
    table = torch.randint(0, num_blocks, (len(seq_lens), width + 2), generator=gen)
    table[:, width:] = GARBAGE_BLOCK
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[start : start + n]
        start += n
    return table.to(dtype=index_dtype, device=DEVICE)


def _strided_query(num_rows: int, num_heads: int, head_dim: int, dtype, gen) -> torch.Tensor:
    """[num_rows, num_heads, head_dim] as a slice of a wider qkv-like buffer (non-contiguous)."""
    qkv = torch.randn(num_rows, num_heads + 5, head_dim, generator=gen).to(dtype=dtype)
    return qkv.to(DEVICE)[:, 2 : 2 + num_heads]


def _assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype) -> None:
    assert out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@dataclass(frozen=True)
class DecodeCase:
    seq_lens: tuple[int, ...]
    group_size: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    num_splits: int | None = None
    pass_max_seq_len: bool = True
    index_dtype: torch.dtype = torch.int32


DECODE_CASES = {
    # One split: the kernel writes the output itself.
    "mha-bs16-d64-one-split": DecodeCase((1, 17, 100), 1, 2, 16, 64, index_dtype=torch.int64),
    "gqa3-bs32-d128-3-splits": DecodeCase((45, 300, 1), 3, 2, 32, 128, num_splits=3),
    # Default plan: 700 tokens -> 3 splits of 256 over 88 blocks of 8.
    "gqa4-bs8-d64-long-default-splits": DecodeCase((700, 129), 4, 2, 8, 64),
    "gqa8-bs16-d128-5-splits": DecodeCase((333, 64, 2), 8, 1, 16, 128, num_splits=5),
    # max_seq_len from the block-table width: 3 splits, some empty for short sequences.
    "gqa4-bs16-d128-bf16": DecodeCase(
        (1, 250, 513), 4, 2, 16, 128, torch.bfloat16, pass_max_seq_len=False
    ),
    "gqa8-bs32-d64-fp16": DecodeCase(
        (77, 190), 8, 2, 32, 64, torch.float16, num_splits=2, index_dtype=torch.int64
    ),
    # 1500 tokens over 94 blocks: 6 splits of 256.
    "mha-bs16-d128-long-6-splits": DecodeCase((1500, 31), 1, 2, 16, 128),
    "gqa8-bs16-d64-bf16-4-splits": DecodeCase(
        (260, 5, 97), 8, 1, 16, 64, torch.bfloat16, num_splits=4
    ),
    # Head dims beyond 128 (32-token tiles) and not a power of two (masked lanes).
    "gqa2-bs16-d256-2-splits": DecodeCase((130, 3), 2, 2, 16, 256, num_splits=2),
    "gqa3-bs64-d96": DecodeCase((200, 64), 3, 1, 64, 96, index_dtype=torch.int64),
}


@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode_matches_reference(case: DecodeCase) -> None:
    gen = torch.Generator().manual_seed(sum(case.seq_lens) + case.group_size)
    num_heads = case.group_size * case.num_kv_heads
    num_blocks = sum(-(-n // case.block_size) for n in case.seq_lens) + 7
    kc, vc = _cache(num_blocks, case.block_size, case.num_kv_heads, case.head_dim, case.dtype, gen)
    bt = _block_tables(list(case.seq_lens), case.block_size, num_blocks, case.index_dtype, gen)
    seq_lens = torch.tensor(case.seq_lens, dtype=case.index_dtype, device=DEVICE)
    query = _strided_query(len(case.seq_lens), num_heads, case.head_dim, case.dtype, gen)
    scale = case.head_dim**-0.5
    max_seq_len = max(case.seq_lens) if case.pass_max_seq_len else None

    out = tk.paged_decode_attention(
        query, kc, vc, bt, seq_lens, scale, max_seq_len, num_splits=case.num_splits
    )
    expected = ref.paged_decode_attention(
        query.float(), kc.float(), vc.float(), bt.long(), seq_lens.long(), scale
    )
    _assert_matches(out, expected, case.dtype)


def test_decode_split_plan() -> None:
    assert tk.decode_split_plan(100, 128) == (1, 256)
    assert tk.decode_split_plan(700, 64) == (3, 256)
    assert tk.decode_split_plan(300, 128, 3) == (3, 128)
    assert tk.decode_split_plan(300, 64, 100) == (5, 64)  # a split holds one tile at least
    assert tk.decode_split_plan(300, 256, 100) == (10, 32)  # 32-token tiles past head dim 128
    splits, tokens = tk.decode_split_plan(10**6, 128)
    assert splits <= tk.DECODE_MAX_SPLITS and splits * tokens >= 10**6


def test_decode_is_batch_invariant() -> None:
    """A sequence's output does not depend on the batch's longest context (the split count)."""
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_dim, group_size = 16, 1, 64, 4
    lens = [300, 600, 40]
    num_blocks = sum(-(-n // block_size) for n in lens)
    kc, vc = _cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, gen)
    bt = _block_tables(lens, block_size, num_blocks, torch.int32, gen)
    query = torch.randn(3, num_kv_heads * group_size, head_dim, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    batch = tk.paged_decode_attention(query, kc, vc, bt, seq_lens, 0.125, 600)  # 3 splits
    alone = tk.paged_decode_attention(query[:1], kc, vc, bt[:1], seq_lens[:1], 0.125, 300)
    assert torch.equal(batch[0], alone[0])


def test_decode_zero_length_row_gives_zeros() -> None:
    """A padding row (seq_len 0, e.g. CUDA-graph padding) yields zeros, not NaN."""
    gen = torch.Generator().manual_seed(4)
    kc, vc = _cache(8, 16, 1, 64, torch.float32, gen)
    bt = _block_tables([40, 40], 16, 8, torch.int32, gen)
    query = torch.randn(2, 2, 64, generator=gen).to(DEVICE)
    seq_lens = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out = tk.paged_decode_attention(query, kc, vc, bt, seq_lens, 0.125, 40, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        expected = ref.paged_decode_attention(query[:1], kc, vc, bt[:1], seq_lens[:1], 0.125)
        _assert_matches(out[:1], expected, torch.float32)


@dataclass(frozen=True)
class PrefillCase:
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # tokens before the chunk: earlier chunks, prefix-cache hits
    group_size: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    pass_max_query_len: bool = True
    index_dtype: torch.dtype = torch.int32


PREFILL_CASES = {
    "one-seq-no-prefix-mha-bs16-d64": PrefillCase((37,), (0,), 1, 2, 16, 64),
    "packed-prefix-gqa4-bs8-d64": PrefillCase(
        (1, 17, 40), (0, 35, 100), 4, 2, 8, 64, pass_max_query_len=False
    ),
    "packed-prefix-gqa3-bs32-d128": PrefillCase(
        (5, 1, 30), (48, 13, 64), 3, 2, 32, 128, index_dtype=torch.int64
    ),
    "prefix-gqa8-bs16-d128": PrefillCase((20, 3), (130, 0), 8, 1, 16, 128),
    "packed-prefix-gqa4-bs16-d128-bf16": PrefillCase(
        (1, 24, 9), (40, 70, 0), 4, 2, 16, 128, torch.bfloat16
    ),
    "prefix-gqa3-bs32-d64-fp16": PrefillCase((33,), (21,), 3, 1, 32, 64, torch.float16),
    "packed-prefix-gqa8-bs32-d64-bf16": PrefillCase(
        (11, 1), (90, 30), 8, 1, 32, 64, torch.bfloat16, pass_max_query_len=False
    ),
    # Two 64-token query tiles against a prefix; head dim 80 is masked to 128 lanes.
    "packed-prefix-mha-bs8-d80": PrefillCase((70, 1), (0, 90), 1, 1, 8, 80),
    "prefix-gqa2-bs16-d256": PrefillCase((12,), (50,), 2, 1, 16, 256),
}


@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_prefill_matches_reference(case: PrefillCase) -> None:
    gen = torch.Generator().manual_seed(sum(case.query_lens) + sum(case.context_lens))
    num_heads = case.group_size * case.num_kv_heads
    lens = [q + c for q, c in zip(case.query_lens, case.context_lens, strict=True)]
    num_blocks = sum(-(-n // case.block_size) for n in lens) + 5
    kc, vc = _cache(num_blocks, case.block_size, case.num_kv_heads, case.head_dim, case.dtype, gen)
    bt = _block_tables(lens, case.block_size, num_blocks, case.index_dtype, gen)
    seq_lens = torch.tensor(lens, dtype=case.index_dtype, device=DEVICE)
    query_lens = torch.tensor((0, *case.query_lens), dtype=case.index_dtype, device=DEVICE)
    query_start_loc = query_lens.cumsum(0).to(case.index_dtype)
    query = _strided_query(sum(case.query_lens), num_heads, case.head_dim, case.dtype, gen)
    scale = case.head_dim**-0.5
    max_query_len = max(case.query_lens) if case.pass_max_query_len else None

    out = tk.paged_prefill_attention(
        query, kc, vc, bt, seq_lens, query_start_loc, scale, max_query_len, max(lens)
    )
    expected = ref.paged_prefill_attention(
        query.float(),
        kc.float(),
        vc.float(),
        bt.long(),
        seq_lens.long(),
        query_start_loc.long(),
        scale,
    )
    _assert_matches(out, expected, case.dtype)


def _window_batch(lens, block_size, num_kv_heads, head_dim, dtype, gen):
    """Strided caches and ``disjoint_tables``."""
    num_blocks, tables = disjoint_tables(lens, block_size, gen)
    kc, vc = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    return kc, vc, tables


def _in_window(lens, q_lens, case, window, gen):
    """Caches with NaN in every row before each sequence's window (the kernels start a token,
    not a block, in), tables, packed queries, and the dense attention of the clean cache."""
    kc, vc, tables = _window_batch(
        lens, case.block_size, case.num_kv_heads, case.head_dim, case.dtype, gen
    )
    num_heads = case.group_size * case.num_kv_heads
    query = _strided_query(sum(q_lens), num_heads, case.head_dim, case.dtype, gen)
    scale = case.head_dim**-0.5
    want = dense_paged(query, kc, vc, tables, lens, q_lens, scale, window)
    poisoned = poison_before((kc, vc), tables, first_needed(lens, q_lens, window), rows=True)
    assert poisoned or window > max(lens)
    bt = torch.tensor(tables, dtype=case.index_dtype, device=DEVICE)
    return kc, vc, bt, query, scale, want


WINDOW_DECODE_CASES = {
    "gqa4-bs16-d64-3-splits": DecodeCase((1, 20, 45, 130), 4, 2, 16, 64, num_splits=3),
    "gqa8-bs16-d64-bf16": DecodeCase((77, 5, 190), 8, 1, 16, 64, torch.bfloat16),
}


def _with_windows(cases: dict) -> list:
    """(case, window) for each case and each window of ``windows`` for its block size."""
    return [
        pytest.param(case, window, id=f"{name}-{label}")
        for name, case in cases.items()
        for label, window in windows(case.block_size).items()
    ]


@pytest.mark.parametrize(("case", "window"), _with_windows(WINDOW_DECODE_CASES))
def test_decode_in_a_window_reads_none_of_the_blocks_before_it(case: DecodeCase, window) -> None:
    gen = torch.Generator().manual_seed(window + case.group_size)
    lens = list(case.seq_lens)
    kc, vc, bt, query, scale, want = _in_window(lens, [1] * len(lens), case, window, gen)
    seq_lens = torch.tensor(lens, dtype=case.index_dtype, device=DEVICE)
    out = tk.paged_decode_attention(
        query, kc, vc, bt, seq_lens, scale, max(lens), window, num_splits=case.num_splits
    )
    _assert_matches(out, want, case.dtype)


WINDOW_PREFILL_CASES = {
    "packed-prefix-gqa4-bs8-d64": PrefillCase((1, 17, 40), (0, 35, 100), 4, 2, 8, 64),
    "packed-prefix-gqa8-bs32-d64-bf16": PrefillCase(
        (11, 1), (90, 30), 8, 1, 32, 64, torch.bfloat16, index_dtype=torch.int64
    ),
    # 64-query tiles over 32-key tiles: a tile's later rows see nothing in its first key tile.
    "packed-prefix-mha-bs16-d256": PrefillCase((70, 2), (60, 0), 1, 1, 16, 256),
}


@pytest.mark.parametrize(("case", "window"), _with_windows(WINDOW_PREFILL_CASES))
def test_prefill_in_a_window_reads_none_of_the_blocks_before_it(case: PrefillCase, window) -> None:
    gen = torch.Generator().manual_seed(window + sum(case.query_lens))
    lens = [q + c for q, c in zip(case.query_lens, case.context_lens, strict=True)]
    q_lens = list(case.query_lens)
    kc, vc, bt, query, scale, want = _in_window(lens, q_lens, case, window, gen)
    seq_lens = torch.tensor(lens, dtype=case.index_dtype, device=DEVICE)
    query_start_loc = torch.tensor((0, *q_lens), device=DEVICE).cumsum(0).to(case.index_dtype)
    out = tk.paged_prefill_attention(
        query, kc, vc, bt, seq_lens, query_start_loc, scale, max(q_lens), max(lens), window
    )
    _assert_matches(out, want, case.dtype)


@pytest.mark.parametrize(
    ("block_size", "key_dtype", "cache_dtype"),
    [
        (16, torch.float32, torch.float32),
        (8, torch.bfloat16, torch.bfloat16),
        (32, torch.float16, torch.float16),
        (16, torch.float32, torch.bfloat16),
    ],
)
def test_write_kv_matches_reference(block_size: int, key_dtype, cache_dtype) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 64, 21
    kc, vc = _cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    # key/value as strided slices of a fused kv projection output
    kv_new = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen)
    kv_new = kv_new.to(dtype=key_dtype, device=DEVICE)
    key, value = kv_new[:, 0], kv_new[:, 1]
    kc_ref, vc_ref = kc.clone(), vc.clone()

    tk.write_kv(key, value, kc, vc, slots)
    ref.write_kv(key, value, kc_ref, vc_ref, slots)
    if key_dtype == cache_dtype:
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    else:  # the interpreter truncates on a narrowing cast, the GPU rounds: one ulp apart
        torch.testing.assert_close(kc, kc_ref, atol=0, rtol=2**-7)
        torch.testing.assert_close(vc, vc_ref, atol=0, rtol=2**-7)


def test_write_kv_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(5)
    kc, vc = _cache(2, 16, 2, 64, torch.float32, gen)
    before_k, before_v = kc.clone(), vc.clone()
    key = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    value = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    slots = torch.tensor([5, -1, 20], device=DEVICE)

    tk.write_kv(key, value, kc, vc, slots)
    written = torch.zeros(2, 16, dtype=torch.bool, device=DEVICE)
    written[0, 5] = written[1, 4] = True
    assert torch.equal(kc[0, 5], key[0]) and torch.equal(vc[1, 4], value[2])
    assert torch.equal(kc[~written], before_k[~written])
    assert torch.equal(vc[~written], before_v[~written])


def test_module_imports_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    # The backend and the modules it imports load afresh; monkeypatch puts the loaded ones back.
    for name in [n for n in sys.modules if n.startswith("pdserve.kernels.triton_")]:
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(pdserve.kernels, name.removeprefix("pdserve.kernels."))
    module = importlib.import_module("pdserve.kernels.triton_attention")

    assert module.TRITON_AVAILABLE is False
    with pytest.raises(RuntimeError, match="triton is not installed"):
        module.write_kv(None, None, None, None, None)
