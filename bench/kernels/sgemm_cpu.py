"""The float32 sgemm kernel (kernels/csrc/cpu_sgemm.c) against oneDNN's packed linear.

One decode step's linears of the model (each layer's fused q|k|v, o, fused gate|up and
down, then lm_head; random weights of the model's shapes, about 540 MB for SmolLM2, so
they come from memory as in a step) at each row count, the two kernels alternating,
best of --repeats. Writes a RESULTS.md section with --write-results. ``--isa avx2`` runs
the kernel where the engine would keep oneDNN (CPUs with AVX-512).

    .venv/bin/python -m bench.kernels.sgemm_cpu --write-results
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import torch

from bench import ROOT
from bench.kernels.gemm_ceiling import Shapes, fused
from bench.results_md import machine, replace_section
from pdserve.engine.prepare_model import resolve_model
from pdserve.kernels import sgemm_cpu


def step_shapes(s: Shapes) -> list[tuple[int, int]]:
    """(N, K) of every linear of one step, in order, as the engine fuses them."""
    (qkv_k, qkv_n), (up_k, up_n) = fused(s)
    _, _, _, (o_k, o_n), _, _, (down_k, down_n) = s.linears()
    layer = [(qkv_n, qkv_k), (o_n, o_k), (up_n, up_k), (down_n, down_k)]
    return layer * s.layers + [(s.vocab, s.hidden)]


def run_sgemm(shapes, packed, xs, isa: str | None = None) -> None:
    for (n, k), p in zip(shapes, packed, strict=True):
        sgemm_cpu.linear(xs[k], p, None, n, isa=isa)


def run_onednn(shapes, packed, xs) -> None:
    for (_, k), p in zip(shapes, packed, strict=True):
        torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2-135M)")
    ap.add_argument("--rows", default="1,4,16,32,64,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    ap.add_argument(
        "--isa", default=None, help="the kernel's variant (default: the one the engine takes)"
    )
    args = ap.parse_args()
    if not sgemm_cpu.available(args.isa):
        print(
            "no sgemm kernel here: the engine takes it on CPUs with AVX2 and without "
            "AVX-512 (--isa avx2 runs it on any CPU with AVX2)"
        )
        return 1

    from transformers import AutoConfig

    path = resolve_model(args.model)
    shapes = step_shapes(Shapes.from_config(AutoConfig.from_pretrained(path)))
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in shapes]
    ours = [sgemm_cpu.pack(w, isa=args.isa) for w in weights]
    flops_per_row = sum(2 * n * k for n, k in shapes)
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
        xs = {k: torch.randn(m, k) for _, k in shapes}
        runs = {
            "sgemm": partial(run_sgemm, shapes, ours, xs, args.isa),
            "onednn": partial(run_onednn, shapes, onednn, xs),
        }
        best = {name: float("inf") for name in runs}
        for fn in runs.values():
            fn()
        for _ in range(args.repeats):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        rows.append((m, best["onednn"], best["sgemm"]))
        print(
            f"{m:5d} rows: oneDNN {best['onednn'] * 1e3:8.1f} ms, sgemm "
            f"{best['sgemm'] * 1e3:8.1f} ms ({best['onednn'] / best['sgemm']:.2f}x)",
            flush=True,
        )
    if args.write_results:
        table = "\n".join(
            f"| {m} | {a * 1e3:.1f} | {m * flops_per_row / a / 1e9:.0f} | {b * 1e3:.1f} | "
            f"{m * flops_per_row / b / 1e9:.0f} | {a / b:.2f}x |"
            for m, a, b in rows
        )
        replace_section(
            ROOT / "bench/RESULTS.md",
            "sgemm-cpu",
            f"""## float32 linears on AVX2: the sgemm kernel against oneDNN (issue 13)

Machine: {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads.
Model shapes: {path.name}, one decode step's {len(shapes)} linears in order (fused q|k|v and
gate|up, lm_head last; {sum(n * k for n, k in shapes) * 4 / 2**20:.0f} MiB of weights, read
from memory), the two kernels alternating, best of {args.repeats}.

| rows | oneDNN ms | GFLOP/s | sgemm ms | GFLOP/s | speed-up |
|---|---|---|---|---|---|
{table}

Command: `.venv/bin/python -m bench.kernels.sgemm_cpu --repeats {args.repeats} --write-results`
""",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
