"""Prefill -> decode transfer of a prompt's KV blocks on loopback: NIXL against gRPC through
a kvstore, against this machine's memory copy bandwidth, measured in the same run.

Blocks of SmolLM2-135M's bf16 layout (368,640 bytes: 30 layers x 2 x 3 KV heads x 16 tokens
x 64 dims x 2 bytes), random bytes, 64 MiB to 1 GiB of them. Each path is timed from "the
prefill worker holds the exported blocks" to "the decode worker holds them, checked":

- nixl: the prefill process stages them (a copy into NIXL-registered slots and each
  block's CRC-32, ``NixlEndpoint.stage``); the decode process reads them over UCX into its
  own slots and checks each CRC (``NixlEndpoint.read``). Both measured, and the read alone.
- grpc: PutBlocks to a kvstore process (the CRCs computed, as a prefill worker does), then
  GetBlocks (each block's header and CRC checked, as a decode worker does).
- copy: torch ``copy_`` of the same bytes between two tensors in one process (the
  machine's memory copy bandwidth, torch's threads).

Medians of --repeats runs; writes bench/out/nixl_transfer.json.

    .venv/bin/python -m bench.serving.nixl_transfer --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.gpu.nixl_vram import read_between_processes

BLOCK = 30 * 2 * 3 * 16 * 64 * 2  # SmolLM2-135M, bfloat16
SIZES_MIB = (64, 256, 1024)


def _blocks(n: int, seed: int):
    import numpy as np

    from pdserve.kv.blocks import ExportedBlock

    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, BLOCK), dtype=np.uint8)
    return [
        ExportedBlock(seed.to_bytes(4, "little") + i.to_bytes(8, "little"), memoryview(data[i]), 16)
        for i in range(n)
    ]


def _prefill_side(conn, buffer_bytes: int) -> None:
    """The prefill process: stages what it is asked to and reports where and how long."""
    from pdserve.worker.nixl import NixlEndpoint

    endpoint = NixlEndpoint(f"bench-prefill-{os.getpid()}", buffer_bytes, BLOCK)
    loop = asyncio.new_event_loop()
    conn.send((endpoint.name, endpoint.metadata()))
    while (ask := _polling(conn, endpoint, loop)) is not None:
        n, seed, lease = ask
        blocks = _blocks(n, seed)
        began = time.perf_counter()
        staged = loop.run_until_complete(endpoint.stage(lease, blocks))
        took = time.perf_counter() - began
        conn.send((staged.addresses, staged.checksums, took, [b.key for b in blocks]))
        _polling(conn, endpoint, loop)  # the read is over
        endpoint.slots.release(lease)
    endpoint.close()


def _polling(conn, endpoint, loop):
    """The next message, the endpoint's notifications read meanwhile (as a prefill worker
    reads them every 20 ms: that also progresses its agent)."""
    while not conn.poll(0.005):
        loop.run_until_complete(endpoint.poll())
    return conn.recv()


def measure_nixl(sizes: list[int], repeats: int) -> dict[int, dict]:
    from pdserve.worker.nixl import NixlEndpoint

    top = max(sizes) * 2**20
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_prefill_side, args=(theirs, top + BLOCK))
    proc.start()
    name, metadata = ours.recv()
    endpoint = NixlEndpoint(f"bench-decode-{os.getpid()}", top + BLOCK, BLOCK)
    results = {}
    try:
        for mib in sizes:
            n = mib * 2**20 // BLOCK
            stage, read, runs = [], [], []
            for r in range(repeats + 1):  # the first run warms pages and the connection
                lease = f"bench-{mib}-{r}"
                ours.send((n, r, lease))
                addresses, checksums, staged_s, keys = ours.recv()
                wanted = list(zip(keys, addresses, checksums, [16] * n, strict=True))
                began = time.perf_counter()
                fetched = asyncio.run(endpoint.read(name, name, metadata, lease, wanted, 120))
                read_s = time.perf_counter() - began
                assert len(fetched.found) == n, f"{len(fetched.rejected)} blocks failed their CRC"
                fetched.done()
                ours.send("done")
                if r:
                    stage.append(staged_s)
                    read.append(read_s)
                    runs.append(staged_s + read_s)
            nbytes = n * BLOCK
            results[mib] = {
                "bytes": nbytes,
                "stage_s": statistics.median(stage),
                "read_s": statistics.median(read),
                "transfer_s": statistics.median(runs),
                "transfer_gbps": nbytes / statistics.median(runs) / 1e9,
                "read_gbps": nbytes / statistics.median(read) / 1e9,
            }
    finally:
        ours.send(None)
        proc.join(60)
        endpoint.close()
    return results


def measure_grpc(sizes: list[int], repeats: int) -> dict[int, dict]:
    from pdserve.kv.blocks import LAYOUT_VERSION, BlockLayout
    from pdserve.kv.client import KVStoreClient
    from pdserve.kv.convert import layout_to_proto
    from pdserve.local.launcher import Launcher

    layout = layout_to_proto(BlockLayout(LAYOUT_VERSION, b"bench-nixl", "bfloat16", 16, 30, 3, 64))
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="nixl-transfer-")))
    argv = [sys.executable, "-m", "pdserve.kvstore", "--port", "0"]
    argv += ["--capacity-bytes", str(3 * max(sizes) * 2**20), "--block-lease", "0"]
    kvstore = launcher.start_ready("kvstore", argv, ["kvstore"], timeout=60)
    results = {}

    async def one(n: int, seed: int) -> tuple[float, float]:
        blocks = [(b.key, b.data, b.num_tokens) for b in _blocks(n, seed)]
        async with KVStoreClient(kvstore.address) as client:
            began = time.perf_counter()
            await client.put_blocks(layout, blocks, timeout=300)
            put_s = time.perf_counter() - began
            began = time.perf_counter()
            fetched = await client.get_blocks(layout, [k for k, _, _ in blocks], timeout=300)
            get_s = time.perf_counter() - began
            assert len(fetched.found) == n, fetched.rejected
        return put_s, get_s

    try:
        for mib in sizes:
            n = mib * 2**20 // BLOCK
            puts, gets = [], []
            for r in range(repeats + 1):
                put_s, get_s = asyncio.run(one(n, 1000 + r))
                if r:
                    puts.append(put_s)
                    gets.append(get_s)
            total = statistics.median([p + g for p, g in zip(puts, gets, strict=True)])
            results[mib] = {
                "bytes": n * BLOCK,
                "put_s": statistics.median(puts),
                "get_s": statistics.median(gets),
                "transfer_s": total,
                "transfer_gbps": n * BLOCK / total / 1e9,
            }
    finally:
        launcher.stop([kvstore])
    return results


def measure_copy(sizes: list[int], repeats: int) -> dict[int, float]:
    import torch

    out = {}
    for mib in sizes:
        a = torch.randint(0, 255, (mib * 2**20,), dtype=torch.uint8)
        b = torch.empty_like(a)
        b.copy_(a)  # pages touched
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - began)
        out[mib] = a.numel() / statistics.median(times) / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=list(SIZES_MIB))
    args = parser.parse_args(argv)
    import torch

    copy = measure_copy(args.sizes_mib, 5)
    nixl = measure_nixl(args.sizes_mib, args.repeats)
    # The transport alone: one descriptor, no per-block work, no CRC.
    raw = read_between_processes(max(args.sizes_mib), args.repeats, "cpu", "cpu")
    grpc_ = measure_grpc(args.sizes_mib, args.repeats)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}, UCX_TLS={os.environ.get('UCX_TLS', '(default)')}"
    )
    print(
        "| MiB | copy GB/s | NIXL stage + read GB/s (of copy) | NIXL read alone GB/s "
        "| gRPC put + get GB/s | NIXL / gRPC |"
    )
    print("|---|---|---|---|---|---|")
    for mib in args.sizes_mib:
        n, g, c = nixl[mib], grpc_[mib], copy[mib]
        print(
            f"| {mib} | {c:.2f} | {n['transfer_gbps']:.2f} ({n['transfer_gbps'] / c:.0%}) "
            f"| {n['read_gbps']:.2f} ({n['read_gbps'] / c:.0%}) | {g['transfer_gbps']:.2f} "
            f"| {n['transfer_gbps'] / g['transfer_gbps']:.1f}x |"
        )
    print(
        f"one {max(args.sizes_mib)} MiB NIXL READ, one descriptor, no CRC: {raw:.2f} GB/s "
        f"({raw / copy[max(args.sizes_mib)]:.0%} of copy)"
    )
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "nixl_transfer.json").write_text(
        json.dumps({"copy_gbps": copy, "nixl": nixl, "grpc": grpc_, "raw_read_gbps": raw}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
