"""KV block transfer through a kvstore process on 127.0.0.1: put and get throughput.

N blocks of one size (default: a SmolLM2-135M block in float32: 30 layers x 2 (K, V)
x 3 KV heads x 16 tokens x 64 dims x 4 bytes = 737,280 bytes), 1,000 blocks. Each
run puts all blocks in one streamed PutBlocks and gets them back in one GetBlocks;
the ceiling is an in-process copy of the same bytes. Reports medians of --repeats
runs and writes bench/out/kv_transfer.json.

With the real model (the default; --no-model skips it) it also measures, for prompts of
several lengths, a disaggregated request's time to first token -- prefill on one engine,
export of the prompt's blocks, PutBlocks -- and the share of it spent on transfer, plus
what the decode side pays before its first step (GetBlocks and the import into its cache).

    .venv/bin/python -m bench.serving.kv_transfer --repeats 3 --write-results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from bench import ROOT
from pdserve.kv.client import KVStoreClient
from pdserve.local.launcher import Child, Launcher
from pdserve.runtime.rpc import STREAM_CHUNK_BYTES
from pdserve.v1 import common_pb2

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
            seconds, fetched = await atimed(
                client.get_blocks(SMOLLM2_LAYOUT, keys, timeout=timeout)
            )
            get_s.append(seconds)
            bad = fetched.missing or fetched.rejected
            if r == 0 and (bad or any(fetched.found[k] != d for k, d, _ in blocks)):
                raise RuntimeError(
                    f"get returned wrong blocks ({len(fetched.missing)} missing, "
                    f"{len(fetched.rejected)} rejected)"
                )
            del fetched
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


def start_kvstore(launcher: Launcher, capacity_bytes: int) -> Child:
    """A kvstore process of ``capacity_bytes`` on a free port, once it serves."""
    argv = [sys.executable, "-m", "pdserve.kvstore", "--port", "0"]
    argv += ["--capacity-bytes", str(capacity_bytes)]
    return launcher.start_ready("kvstore", argv, ["kvstore"], timeout=30)


def measure_ttft(address: str, prompt_lens: list[int], repeats: int, timeout: float) -> list[dict]:
    """Prefill -> export -> put (the TTFT path), then get -> import (before decode), per length."""
    import random

    from pdserve.core.sampling import SamplingParams
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.prepare_model import resolve_model
    from pdserve.kv.convert import layout_to_proto
    from pdserve.settings.engine import EngineArgs

    path = str(resolve_model(None))
    args = EngineArgs(dtype="float32", max_model_len=4096, kv_cache_memory="1GiB")
    prefill, decode = LLMEngine(args, path), LLMEngine(args, path)
    layout = layout_to_proto(prefill.block_layout())
    rng = random.Random(0)
    rows = []

    async def run_one(client, n: int, rid: str) -> dict:
        prompt = [rng.randrange(100, 40000) for _ in range(n)]
        t0 = time.perf_counter()
        seq = prefill.add_request(
            prompt, SamplingParams(max_tokens=2, temperature=0), rid, prefill_only=True
        )
        while prefill.has_unfinished():
            prefill.step()
        t1 = time.perf_counter()
        blocks = prefill.export_prompt_blocks(rid)
        t2 = time.perf_counter()
        await client.put_blocks(
            layout, [(b.key, b.data, b.num_tokens) for b in blocks], timeout=timeout
        )
        t3 = time.perf_counter()
        fetched = await client.get_blocks(layout, [b.key for b in blocks], timeout=timeout)
        t4 = time.perf_counter()
        assert not fetched.missing and not fetched.rejected
        decode.pool.reset_prefix_cache()
        dseq = decode.add_imported_request(
            prompt, SamplingParams(max_tokens=1), rid, seq.output_token_ids[0], None, fetched.found
        )
        t5 = time.perf_counter()
        assert dseq.num_imported_tokens == n
        nbytes = sum(len(b.data) for b in blocks)
        copy_s = timed(lambda: [bytes(memoryview(b.data)) for b in blocks])
        return {
            "prefill_s": t1 - t0,
            "export_s": t2 - t1,
            "put_s": t3 - t2,
            "get_s": t4 - t3,
            "import_s": t5 - t4,
            "bytes": nbytes,
            "copy_s": copy_s,
        }

    async def run() -> None:
        async with KVStoreClient(address) as client:
            await run_one(client, 64, "warmup")
            for n in prompt_lens:
                runs = [await run_one(client, n, f"p{n}-{r}") for r in range(repeats)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                ttft = med["prefill_s"] + med["export_s"] + med["put_s"]
                rows.append(
                    {
                        "prompt_tokens": n,
                        **med,
                        "ttft_s": ttft,
                        "bytes_per_token": med["bytes"] / n,
                        "transfer_share_of_ttft": (med["export_s"] + med["put_s"]) / ttft,
                        "decode_side_s": med["get_s"] + med["import_s"],
                    }
                )

    asyncio.run(run())
    return rows


def ttft_table(rows: list[dict]) -> str:
    lines = [
        "| prompt tokens | KV bytes | bytes/token | prefill ms | export ms | put ms | TTFT ms | transfer share of TTFT | get + import ms (decode side) | in-process copy ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']} | {r['bytes'] / 1e6:.1f} MB | {r['bytes_per_token']:,.0f} | "
            f"{r['prefill_s'] * 1e3:.0f} | {r['export_s'] * 1e3:.1f} | {r['put_s'] * 1e3:.1f} | "
            f"{r['ttft_s'] * 1e3:.0f} | {r['transfer_share_of_ttft']:.1%} | "
            f"{r['decode_side_s'] * 1e3:.1f} | {r['copy_s'] * 1e3:.1f} |"
        )
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
    ap.add_argument("--no-model", action="store_true", help="skip the TTFT part (real model)")
    ap.add_argument(
        "--prompt-lens", default="128,512,2048", help="prompt lengths for the TTFT part"
    )
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    if args.num_blocks < 8 or args.block_bytes < 1 or args.repeats < 1:
        ap.error("--num-blocks must be >= 8, --block-bytes and --repeats >= 1")

    total = args.num_blocks * args.block_bytes
    blocks = make_blocks(args.num_blocks, args.block_bytes)
    copy_s = [timed(lambda: copy_all(blocks)) for _ in range(args.repeats)]

    launcher = Launcher(Path(tempfile.mkdtemp(prefix="kv-transfer-")))
    # Room for every block (and the warm-up), so that no run evicts.
    kvstore = start_kvstore(launcher, total + 2 * STREAM_CHUNK_BYTES)
    try:
        transfer = asyncio.run(
            measure_transfer(kvstore.address, blocks, args.repeats, args.timeout)
        )
    finally:
        launcher.stop([kvstore])
    ttft = []
    if not args.no_model:  # a fresh store: a kvstore holds one model's layout for life
        kvstore = start_kvstore(launcher, 2**30)
        try:
            lens = [int(x) for x in args.prompt_lens.split(",")]
            ttft = measure_ttft(kvstore.address, lens, args.repeats, args.timeout)
        finally:
            launcher.stop([kvstore])

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
    result["ttft"] = ttft

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"KV transfer through a kvstore on 127.0.0.1: {args.num_blocks:,} blocks x "
        f"{args.block_bytes:,} B = {total / 1e6:,.1f} MB per run, {args.repeats} runs"
    )
    print(result["machine"])
    print(table(result))
    if ttft:
        print(ttft_table(ttft))
    print(f"wrote {args.out}")
    if args.write_results:
        from bench.results_md import replace_section

        body = (
            "## KV transfer through the kvstore (issue 3)\n\n"
            f"Machine: {result['machine']}. Command: `.venv/bin/python -m bench.serving.kv_transfer "
            f"--repeats {args.repeats} --write-results` (medians of {args.repeats} runs).\n\n"
            f"Throughput, {args.num_blocks:,} blocks of {args.block_bytes:,} B (a SmolLM2-135M "
            "float32 block) through a kvstore process on 127.0.0.1, against an in-process copy "
            "of the same bytes:\n\n" + table(result) + "\n"
        )
        if ttft:
            body += (
                "\nA disaggregated request with the real SmolLM2-135M (float32): TTFT = prefill + "
                "export of the prompt's blocks + PutBlocks; the decode side then pays GetBlocks + "
                "the import into its cache before its first step:\n\n" + ttft_table(ttft) + "\n"
            )
        replace_section(ROOT / "bench/RESULTS.md", "kv-transfer", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
