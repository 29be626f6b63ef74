"""KV block transfer through a kvstore process on 127.0.0.1: put and get throughput.

N blocks of one size (default: a SmolLM2-135M block in float32: 30 layers x 2 (K, V)
x 3 KV heads x 16 tokens x 64 dims x 4 bytes = 737,280 bytes), 1,000 blocks. Each
run puts all blocks in one streamed PutBlocks and gets them back in one GetBlocks;
the ceiling is an in-process copy of the same bytes. Reports medians of --repeats
runs and writes bench/out/kv_transfer.json.

    .venv/bin/python bench/kv_transfer.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.grpc_utils import STREAM_CHUNK_BYTES  # noqa: E402
from services.common.pb import common_pb2  # noqa: E402
from services.kvstore.client import KVStoreClient  # noqa: E402
from services.kvstore.launch import start_kvstore  # noqa: E402

# SmolLM2-135M's KV block: 30 layers, 3 KV heads, head dim 64, 16 tokens per block.
SMOLLM2_LAYOUT = common_pb2.BlockLayout(
    version=1,
    model_fingerprint=b"bench-kv-transfer",
    dtype="float32",
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)
FLOAT32_BYTES = 4


def block_bytes(layout: common_pb2.BlockLayout, itemsize: int) -> int:
    """Bytes of one block: [layers, 2, kv_heads, block_size, head_dim] values."""
    return (
        layout.num_layers * 2 * layout.num_kv_heads * layout.block_size * layout.head_dim * itemsize
    )


def make_blocks(num_blocks: int, size: int) -> list[tuple[bytes, bytes, int]]:
    """Random (key, data, num_tokens) blocks, so that nothing compresses or dedups."""
    return [(f"bench/{i}".encode(), os.urandom(size), 16) for i in range(num_blocks)]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def atimed(coro) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = await coro
    return time.perf_counter() - t0, result


def copy_all(blocks: list[tuple[bytes, bytes, int]]) -> list[bytes]:
    # bytes(memoryview(b)) makes a new bytes object: one real copy, as a receiver would.
    return [bytes(memoryview(data)) for _, data, _ in blocks]


async def measure_transfer(
    address: str, blocks: list[tuple[bytes, bytes, int]], repeats: int, timeout: float
) -> dict:
    """Seconds of each put and get run, alternating; the first get is checked for content."""
    keys = [key for key, _, _ in blocks]
    put_s, get_s = [], []
    async with KVStoreClient(address) as client:
        # Warm up the channel and the server's allocator.
        await client.put_blocks(SMOLLM2_LAYOUT, blocks[:8], timeout=timeout)
        await client.get_blocks(SMOLLM2_LAYOUT, keys[:8], timeout=timeout)
        for r in range(repeats):
            seconds, _ = await atimed(client.put_blocks(SMOLLM2_LAYOUT, blocks, timeout=timeout))
            put_s.append(seconds)
            seconds, (found, missing) = await atimed(
                client.get_blocks(SMOLLM2_LAYOUT, keys, timeout=timeout)
            )
            get_s.append(seconds)
            if r == 0 and (missing or any(found[k] != d for k, d, _ in blocks)):
                raise RuntimeError(f"get returned wrong blocks ({len(missing)} missing)")
            del found
        stat = await client.stat(timeout=timeout)
    return {"put_s": put_s, "get_s": get_s, "evictions": stat.evictions}


def mb_per_s(total_bytes: int, seconds: list[float]) -> list[float]:
    return [total_bytes / 1e6 / s for s in seconds]


def table(result: dict) -> str:
    copy = result["copy_median_mb_s"]
    rows = [
        ("put (client -> kvstore)", result["put_mb_s"], result["put_median_mb_s"]),
        ("get (kvstore -> client)", result["get_mb_s"], result["get_median_mb_s"]),
        ("in-process bytes copy", result["copy_mb_s"], copy),
    ]
    runs = len(result["put_mb_s"])
    head = "| path | " + " | ".join(f"run {i + 1}" for i in range(runs))
    lines = [
        head + " | median MB/s | of copy |",
        "|---" * (runs + 3) + "|",
    ]
    for name, values, median in rows:
        cells = " | ".join(f"{v:,.0f}" for v in values)
        lines.append(f"| {name} | {cells} | **{median:,.0f}** | {median / copy:.1%} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_size = block_bytes(SMOLLM2_LAYOUT, FLOAT32_BYTES)
    ap.add_argument("--num-blocks", type=int, default=1000)
    ap.add_argument(
        "--block-bytes", type=int, default=default_size, help=f"default {default_size:,}"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline of each call, s")
    ap.add_argument("--out", default=str(ROOT / "bench/out/kv_transfer.json"))
    args = ap.parse_args()
    if args.num_blocks < 8 or args.block_bytes < 1 or args.repeats < 1:
        ap.error("--num-blocks must be >= 8, --block-bytes and --repeats >= 1")

    total = args.num_blocks * args.block_bytes
    blocks = make_blocks(args.num_blocks, args.block_bytes)
    copy_s = [timed(lambda: copy_all(blocks)) for _ in range(args.repeats)]

    # Room for every block (and the warm-up), so that no run evicts.
    kvstore = start_kvstore(capacity_bytes=total + 2 * STREAM_CHUNK_BYTES)
    try:
        transfer = asyncio.run(
            measure_transfer(kvstore.address, blocks, args.repeats, args.timeout)
        )
    finally:
        kvstore.stop()

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}",
        "num_blocks": args.num_blocks,
        "block_bytes": args.block_bytes,
        "total_bytes": total,
        "stream_chunk_bytes": STREAM_CHUNK_BYTES,
        "put_s": transfer["put_s"],
        "get_s": transfer["get_s"],
        "copy_s": copy_s,
        "put_mb_s": mb_per_s(total, transfer["put_s"]),
        "get_mb_s": mb_per_s(total, transfer["get_s"]),
        "copy_mb_s": mb_per_s(total, copy_s),
        "evictions": transfer["evictions"],
    }
    for name in ("put", "get", "copy"):
        result[f"{name}_median_mb_s"] = statistics.median(result[f"{name}_mb_s"])

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"KV transfer through a kvstore on 127.0.0.1: {args.num_blocks:,} blocks x "
        f"{args.block_bytes:,} B = {total / 1e6:,.1f} MB per run, {args.repeats} runs"
    )
    print(result["machine"])
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
