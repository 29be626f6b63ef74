"""Time the Triton paged-attention kernels on a CUDA GPU against torch baselines.

    python -m bench.gpu.triton_attention [--quick] [--out bench/out/kernels_gpu.json]
                                         [--write-results]

For each shape it first checks the kernel against ``pdserve.kernels.attention_ref`` on the
GPU, then times with ``triton.testing.do_bench`` (median, L2 flushed between runs):
  - the Triton kernel;
  - the torch reference (``pdserve.kernels.attention_ref``: gathers the paged K/V, then SDPA);
  - ``F.scaled_dot_product_attention`` on K/V gathered beforehand into contiguous
    [batch, kv_heads, tokens, head_dim] tensors: the gather is NOT timed, so this is
    the attention math alone on an ideal layout.
Decode reports the K/V bytes read per second against the device's copy bandwidth,
measured in the same run (a large device-to-device copy: bytes read + written / time).
Prefill reports TFLOP/s over the causally visible (query, key) pairs.

Exit codes: 0 done, 1 a correctness check failed, 2 no CUDA device (or no triton).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import ROOT
from bench.results_md import replace_section
from pdserve.kernels import attention_ref as ref
from pdserve.kernels import triton_attention as tk
from pdserve.kernels.triton_common import _interpreting

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Kernel vs reference on the GPU, same inputs. fp32 runs the IEEE (non-TF32) dot path.
TOLERANCES = {
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
}
DEVICE = "cuda"
NUM_LAYERS = 2  # cache views are one layer of the engine's [blocks, layers, 2, ...] buffer


@dataclass(frozen=True)
class BenchConfig:
    """Shapes and timing budget of one run."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bf16"
    decode_batches: tuple[int, ...] = (1, 16, 64)
    decode_contexts: tuple[int, ...] = (512, 4096)
    prefill_chunk: int = 2048
    prefill_prefix: int = 2048
    warmup_ms: int = 25
    rep_ms: int = 100
    copy_mib: int = 2048


QUICK = {
    "decode_batches": (1, 4),
    "decode_contexts": (128, 512),
    "prefill_chunk": 256,
    "prefill_prefix": 256,
    "warmup_ms": 5,
    "rep_ms": 20,
    "copy_mib": 256,
}


@dataclass
class Row:
    """One benchmarked shape: times in ms, None where a baseline did not run."""

    kernel: str
    shape: str
    correct: bool
    max_abs_err: float
    triton_ms: float | None = None
    ref_ms: float | None = None
    sdpa_ms: float | None = None
    gbytes_per_s: float | None = None
    pct_of_copy_bw: float | None = None
    tflops: float | None = None
    notes: list[str] = field(default_factory=list)


class PagedKV:
    """A per-layer K/V cache view with shuffled block tables, num_seqs x context tokens."""

    def __init__(self, cfg: BenchConfig, num_seqs: int, context: int, dtype: torch.dtype):
        bs = cfg.block_size
        self.blocks_per_seq = -(-context // bs)
        num_blocks = num_seqs * self.blocks_per_seq
        # The engine's layout: head-major blocks, seen by kernels as [blocks, bs, Hkv, D].
        kv = torch.randn(
            num_blocks, NUM_LAYERS, 2, cfg.num_kv_heads, bs, cfg.head_dim, device=DEVICE
        ).to(dtype)
        self.key_cache = kv[:, 1, 0].transpose(1, 2)
        self.value_cache = kv[:, 1, 1].transpose(1, 2)
        perm = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32)
        self.block_tables = perm.view(num_seqs, self.blocks_per_seq)
        self.context = context

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous [num_seqs, num_kv_heads, context, head_dim] K and V."""
        bt = self.block_tables.long()
        k = ref._gather_context(self.key_cache, bt, self.context).contiguous()
        v = ref._gather_context(self.value_cache, bt, self.context).contiguous()
        return k, v


def _bench(fn: Callable[[], object], cfg: BenchConfig) -> float:
    import triton.testing

    return float(
        triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")
    )


def _max_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected.float()).abs().max())


def _close(out: torch.Tensor, expected: torch.Tensor) -> bool:
    tol = TOLERANCES[out.dtype]
    finite = bool(torch.isfinite(out).all())
    return finite and bool(torch.allclose(out.float(), expected.float(), **tol))


def _try_time(row: Row, name: str, attr: str, fn: Callable[[], object], cfg: BenchConfig) -> None:
    try:
        fn()
        torch.cuda.synchronize()
        setattr(row, attr, _bench(fn, cfg))
    except Exception as exc:  # a baseline that cannot run is reported, not fatal
        row.notes.append(f"{name} failed: {type(exc).__name__}: {exc}"[:300])


def copy_bandwidth_gbs(cfg: BenchConfig) -> float:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / time."""
    n = cfg.copy_mib << 20
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).fill_(1)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src), cfg)
    return 2 * n / (ms * 1e-3) / 1e9


def bench_decode(
    cfg: BenchConfig, num_seqs: int, context: int, dtype: torch.dtype, copy_gbs: float
) -> Row:
    h, d = cfg.num_heads, cfg.head_dim
    cache = PagedKV(cfg, num_seqs, context, dtype)
    kc, vc, bt = cache.key_cache, cache.value_cache, cache.block_tables
    query = torch.randn(num_seqs, h, d, device=DEVICE).to(dtype)
    scale = d**-0.5
    shape = f"B={num_seqs} ctx={context} H={h}/{cfg.num_kv_heads} D={d} bs={cfg.block_size}"
    splits, _ = tk.decode_split_plan(context, d)

    # Correctness first: mixed lengths (some 1, the rest random up to context), then full.
    mixed = torch.randint(1, context + 1, (num_seqs,), device=DEVICE, dtype=torch.int32)
    mixed[0] = context
    if num_seqs > 1:
        mixed[-1] = 1
    full = torch.full((num_seqs,), context, device=DEVICE, dtype=torch.int32)
    ok, err = True, 0.0
    for seq_lens in (mixed, full):
        out = tk.paged_decode_attention(query, kc, vc, bt, seq_lens, scale, context)
        expected = ref.paged_decode_attention(query, kc, vc, bt, seq_lens, scale, context)
        ok &= _close(out, expected)
        err = max(err, _max_err(out, expected))
    row = Row("decode", shape, ok, err, notes=[f"{splits} split(s)"])
    if not ok:
        return row

    _try_time(
        row,
        "triton",
        "triton_ms",
        lambda: tk.paged_decode_attention(query, kc, vc, bt, full, scale, context),
        cfg,
    )
    _try_time(
        row,
        "reference",
        "ref_ms",
        lambda: ref.paged_decode_attention(query, kc, vc, bt, full, scale, context),
        cfg,
    )
    k, v = cache.gathered()
    q4 = query.unsqueeze(2)  # [B, H, 1, D]
    _try_time(
        row,
        "sdpa",
        "sdpa_ms",
        lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True),
        cfg,
    )
    if row.triton_ms:
        kv_bytes = 2 * num_seqs * context * cfg.num_kv_heads * d * kc.element_size()
        row.gbytes_per_s = kv_bytes / (row.triton_ms * 1e-3) / 1e9
        row.pct_of_copy_bw = 100 * row.gbytes_per_s / copy_gbs
    return row


def _prefill_inputs(cfg: BenchConfig, chunk: int, prefix: int, dtype: torch.dtype):
    cache = PagedKV(cfg, 1, prefix + chunk, dtype)
    query = torch.randn(chunk, cfg.num_heads, cfg.head_dim, device=DEVICE).to(dtype)
    seq_lens = torch.tensor([prefix + chunk], device=DEVICE, dtype=torch.int32)
    query_start_loc = torch.tensor([0, chunk], device=DEVICE, dtype=torch.int32)
    return cache, query, seq_lens, query_start_loc


def _sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Bottom-right-aligned causal SDPA of q [1, H, Q, D] against k, v [1, Hkv, T, D]."""
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def bench_prefill(cfg: BenchConfig, chunk: int, prefix: int, dtype: torch.dtype) -> Row:
    h, d = cfg.num_heads, cfg.head_dim
    cache, query, seq_lens, qsl = _prefill_inputs(cfg, chunk, prefix, dtype)
    kc, vc, bt = cache.key_cache, cache.value_cache, cache.block_tables
    scale = d**-0.5
    total = prefix + chunk
    shape = f"chunk={chunk} prefix={prefix} H={h}/{cfg.num_kv_heads} D={d} bs={cfg.block_size}"

    def run_triton():
        return tk.paged_prefill_attention(query, kc, vc, bt, seq_lens, qsl, scale, chunk, total)

    def run_ref():
        return ref.paged_prefill_attention(query, kc, vc, bt, seq_lens, qsl, scale, chunk, total)

    out, expected = run_triton(), run_ref()
    row = Row("prefill", shape, _close(out, expected), _max_err(out, expected))
    if not row.correct:
        return row
    _try_time(row, "triton", "triton_ms", run_triton, cfg)
    _try_time(row, "reference", "ref_ms", run_ref, cfg)
    k, v = cache.gathered()
    q4 = query.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    _try_time(row, "sdpa", "sdpa_ms", lambda: _sdpa_prefill(q4, k, v, scale), cfg)
    if row.triton_ms:
        pairs = chunk * prefix + chunk * (chunk + 1) // 2  # causally visible (q, k) pairs
        row.tflops = 4 * h * d * pairs / (row.triton_ms * 1e-3) / 1e12
    return row


def bench_write_kv(cfg: BenchConfig, num_tokens: int, dtype: torch.dtype) -> Row:
    cache = PagedKV(cfg, 1, max(num_tokens, cfg.block_size), dtype)
    kc, vc = cache.key_cache, cache.value_cache
    key = torch.randn(num_tokens, cfg.num_kv_heads, cfg.head_dim, device=DEVICE).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(kc.shape[0] * cfg.block_size, device=DEVICE)[:num_tokens]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    tk.write_kv(key, value, kc, vc, slots)
    ref.write_kv(key, value, kc_ref, vc_ref, slots)
    ok = bool(torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref))
    row = Row("write_kv", f"tokens={num_tokens} Hkv={cfg.num_kv_heads} D={cfg.head_dim}", ok, 0.0)
    if ok:
        _try_time(row, "triton", "triton_ms", lambda: tk.write_kv(key, value, kc, vc, slots), cfg)
        _try_time(row, "reference", "ref_ms", lambda: ref.write_kv(key, value, kc, vc, slots), cfg)
        if row.triton_ms:
            moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read + written
            row.gbytes_per_s = moved / (row.triton_ms * 1e-3) / 1e9
    return row


def check_fp32(cfg: BenchConfig) -> list[Row]:
    """Small fp32 decode and prefill checks: the IEEE (non-TF32) dot path compiles and is exact."""
    rows = []
    cache = PagedKV(cfg, 3, 300, torch.float32)
    kc, vc, bt = cache.key_cache, cache.value_cache, cache.block_tables
    query = torch.randn(3, cfg.num_heads, cfg.head_dim, device=DEVICE)
    seq_lens = torch.tensor([1, 300, 77], device=DEVICE, dtype=torch.int32)
    scale = cfg.head_dim**-0.5
    out = tk.paged_decode_attention(query, kc, vc, bt, seq_lens, scale, 300, num_splits=3)
    expected = ref.paged_decode_attention(query, kc, vc, bt, seq_lens, scale, 300)
    rows.append(Row("decode fp32", "B=3 ctx<=300", _close(out, expected), _max_err(out, expected)))
    cache, query, seq_lens, qsl = _prefill_inputs(cfg, 100, 150, torch.float32)
    kc, vc, bt = cache.key_cache, cache.value_cache, cache.block_tables
    out = tk.paged_prefill_attention(query, kc, vc, bt, seq_lens, qsl, scale)
    expected = ref.paged_prefill_attention(query, kc, vc, bt, seq_lens, qsl, scale)
    rows.append(
        Row("prefill fp32", "chunk=100 prefix=150", _close(out, expected), _max_err(out, expected))
    )
    return rows


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[Row], copy_gbs: float) -> str:
    lines = [
        f"Device copy bandwidth (read + write): {copy_gbs:.0f} GB/s",
        "",
        "| kernel | shape | ok | max err | triton ms | ref ms | sdpa ms (pre-gathered)"
        " | x ref | x sdpa | GB/s | % copy BW | TFLOP/s | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs_ref = r.ref_ms / r.triton_ms if r.ref_ms and r.triton_ms else None
        vs_sdpa = r.sdpa_ms / r.triton_ms if r.sdpa_ms and r.triton_ms else None
        lines.append(
            f"| {r.kernel} | {r.shape} | {'yes' if r.correct else 'NO'} | {r.max_abs_err:.2e}"
            f" | {_fmt(r.triton_ms)} | {_fmt(r.ref_ms)} | {_fmt(r.sdpa_ms)}"
            f" | {_fmt(vs_ref, '.2f')} | {_fmt(vs_sdpa, '.2f')} | {_fmt(r.gbytes_per_s, '.0f')}"
            f" | {_fmt(r.pct_of_copy_bw, '.0f')} | {_fmt(r.tflops, '.1f')}"
            f" | {'; '.join(r.notes).replace('|', '/')} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, short timing: a smoke run"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench/out/kernels_gpu.json", help="JSON results path"
    )
    parser.add_argument(
        "--write-results",
        action="store_true",
        help="also write the table as the kernels-gpu section of bench/RESULTS.md",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench.gpu.triton_attention: no CUDA device; this benchmark runs on a GPU only.",
            file=sys.stderr,
        )
        return 2
    if not tk.TRITON_AVAILABLE or _interpreting():
        print(
            "bench.gpu.triton_attention: needs triton installed and TRITON_INTERPRET unset.",
            file=sys.stderr,
        )
        return 2
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        print(
            f"bench.gpu.triton_attention: --block-size must be a power of two, got {args.block_size}",
            file=sys.stderr,
        )
        return 2
    cfg = BenchConfig(block_size=args.block_size, dtype=args.dtype)
    if args.quick:
        cfg = BenchConfig(**{**asdict(cfg), **QUICK})
    dtype = DTYPES[cfg.dtype]
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    import triton

    copy_gbs = copy_bandwidth_gbs(cfg)
    rows = check_fp32(cfg)
    for num_seqs in cfg.decode_batches:
        for context in cfg.decode_contexts:
            rows.append(bench_decode(cfg, num_seqs, context, dtype, copy_gbs))
            torch.cuda.empty_cache()
    rows.append(bench_prefill(cfg, cfg.prefill_chunk, cfg.prefill_prefix, dtype))
    torch.cuda.empty_cache()
    for num_tokens in (max(cfg.decode_batches), cfg.prefill_chunk):
        rows.append(bench_write_kv(cfg, num_tokens, dtype))

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": asdict(cfg),
        "copy_bandwidth_gbs": copy_gbs,
        "timing": "triton.testing.do_bench, median ms, L2 flushed between runs",
        "sdpa_baseline": "F.scaled_dot_product_attention on K/V gathered beforehand into "
        "contiguous [B, Hkv, T, D]; gather time excluded",
        "decode_bandwidth": "K+V bytes read by the kernel / triton time",
        "wall_s": time.perf_counter() - started,
        "results": [asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(rows, copy_gbs)
    print(table)
    if args.write_results:
        header = f"## Triton kernels on {result['device']} ({cfg.dtype})\n\n"
        replace_section(ROOT / "bench/RESULTS.md", "kernels-gpu", header + table)
    print(f"\nwrote {args.out} in {result['wall_s']:.0f} s")
    return 0 if all(r.correct for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
