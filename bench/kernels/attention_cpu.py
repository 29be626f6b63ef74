"""Decode attention on the CPU: the C kernel (``pdserve.kernels.attention_cpu``) against the torch
reference (gather + SDPA), at SmolLM2-135M's shapes, in the engine's cache layout.

    .venv/bin/python -m bench.kernels.attention_cpu [--dtype float32] [--batches 1,16,32]
                                                    [--contexts 256,1024] [--repeats 30]
                                                    [--layers 30] [--isa avx2]

9 query heads, 3 KV heads, head dim 64, blocks of 16 tokens, head-major blocks, shuffled
block tables. With ``--layers 1`` (the default) a measurement is one layer's call on a
cache of that layer alone, which stays in the L3 cache from call to call. With
``--layers N``, the cache holds N layers per block as the engine's does, a measurement
calls each layer once in turn (so each layer's K/V come from memory, as in a decode
step), and the figure is per layer call. Medians of ``--repeats`` measurements after a
warm-up. Prints which variant of the kernels ran: the widest this CPU runs, or ``--isa``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

from bench.timing import median_ms
from pdserve.kernels import attention_cpu, attention_ref
from pdserve.kernels.cpu_build import variants_here

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def case(
    batch: int,
    context: int,
    dtype: torch.dtype,
    repeats: int,
    layers: int = 1,
    isa: str | None = None,
) -> tuple[float, float]:
    """(C kernel ms, reference ms) for one layer's decode attention, the kernel in variant
    ``isa`` (default: the widest this CPU runs)."""
    gen = torch.Generator().manual_seed(batch * 10_000 + context)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    kv = torch.randn(num_blocks, layers, 2, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    caches = [(kv[:, i, 0].transpose(1, 2), kv[:, i, 1].transpose(1, 2)) for i in range(layers)]
    perm = torch.randperm(num_blocks, generator=gen)[: batch * per_seq]
    tables = perm.view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5
    args = (query, *caches[-1], tables, lens, scale)
    kernel = partial(attention_cpu.paged_decode_attention, isa=isa)
    got = kernel(*args)  # also the warm-up of each
    want = attention_ref.paged_decode_attention(*args)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)

    def sweep(fn):
        return lambda: [fn(query, k, v, tables, lens, scale) for k, v in caches]

    return (
        median_ms(sweep(kernel), repeats) / layers,
        median_ms(sweep(attention_ref.paged_decode_attention), repeats) / layers,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers per cache block (the engine's layout; 30 for SmolLM2): K/V from memory",
    )
    ap.add_argument(
        "--isa",
        choices=variants_here("attention"),
        default=None,
        help="the kernels' variant (default: the widest this CPU runs)",
    )
    args = ap.parse_args(argv)
    if not attention_cpu.available():
        print(f"the C kernels do not build here: {attention_cpu.build_error()}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    print(
        f"kernel path: {args.isa or attention_cpu.vector_path()}, "
        f"{torch.get_num_threads()} threads, "
        f"{args.layers} layer(s) per block; ms per layer call"
    )
    print("| batch | context | C kernel ms | torch reference ms | speed-up |")
    print("|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            c_ms, ref_ms = case(batch, context, dtype, args.repeats, args.layers, args.isa)
            print(f"| {batch} | {context} | {c_ms:.3f} | {ref_ms:.3f} | {ref_ms / c_ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
