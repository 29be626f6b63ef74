"""What a checksum of one KV block costs, for the checksums this environment has.

A SmolLM2-135M block: 16 tokens x 30 layers x 2 (K, V) x 3 KV heads x 64 dims, in bfloat16
(368,640 bytes) and float32 (737,280). Each candidate hashes random blocks; the median of
--repeats passes over --num-blocks blocks gives microseconds per block and GB/s. The
prefill worker pays one checksum per block it pushes, the decode worker one per block it
fetches (``services/kv/blocks.py``, ``block_checksum``).

    .venv/bin/python -m bench.kernels.block_checksum
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable

from pdserve.kv.blocks import block_checksum

CANDIDATES: dict[str, Callable[[bytes], object]] = {
    "zlib.crc32": zlib.crc32,
    "zlib.adler32": zlib.adler32,
    "block_checksum (crc32 of key, count, bytes)": lambda d: block_checksum(b"k" * 16, 16, d),
    "hashlib.blake2b(16)": lambda d: hashlib.blake2b(d, digest_size=16).digest(),
    "hashlib.md5": lambda d: hashlib.md5(d).digest(),
    "hashlib.sha1": lambda d: hashlib.sha1(d).digest(),
    "hashlib.sha256": lambda d: hashlib.sha256(d).digest(),
}
SMOLLM2_VALUES = 16 * 30 * 2 * 3 * 64


def per_block_us(fn: Callable[[bytes], object], blocks: list[bytes], repeats: int) -> float:
    """Median over ``repeats`` passes of microseconds per block."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in blocks:
            fn(b)
        times.append((time.perf_counter() - t0) / len(blocks) * 1e6)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"zlib {zlib.ZLIB_RUNTIME_VERSION}, {os.cpu_count()} CPUs")
    print("| checksum | bf16 block us | bf16 GB/s | fp32 block us | fp32 GB/s |")
    print("|---|---|---|---|---|")
    sizes = (SMOLLM2_VALUES * 2, SMOLLM2_VALUES * 4)
    sets = [[os.urandom(size) for _ in range(args.num_blocks)] for size in sizes]
    for name, fn in CANDIDATES.items():
        cells = []
        for size, blocks in zip(sizes, sets, strict=True):
            us = per_block_us(fn, blocks, args.repeats)
            cells += [f"{us:,.0f}", f"{size / us / 1e3:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
