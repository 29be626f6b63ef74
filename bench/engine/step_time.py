"""The engine's decode step time in two variants of the CPU path, side by side.

    .venv/bin/python -m bench.engine.step_time [--compare cpu-ops|sgemm] [--dtype bfloat16]
                                               [--batches 1,16] [--rounds 3]

``--compare cpu-ops`` (the default): the C++ CPU ops against the Python ops
(``PDSERVE_CPU_OPS=python`` keeps the Python ops; the default uses the C++ ops and
inductor's C++ wrapper where they build). ``--compare sgemm``: float32 linears through
the sgemm kernel against oneDNN (``PDSERVE_CPU_SGEMM=0``).
Each round runs one process per variant, alternating. A
process starts the engine on SmolLM2 (warm compile cache assumed: run once first), then
for each batch size B adds B prompts of 256 tokens, decodes 48 tokens each and takes the
median time of the last 40 steps (all decode at a 256-304 token context); three such
repeats give the process's figure (their median). The table gives each variant's median
over the rounds, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT

COMPARISONS = {
    "cpu-ops": {"python ops": {"PDSERVE_CPU_OPS": "python"}, "C++ ops": {}},
    "sgemm": {"oneDNN": {"PDSERVE_CPU_SGEMM": "0"}, "sgemm": {}},
}


def decode_step_ms(engine, batches: list[int]) -> dict[int, float]:
    """For each batch size B: B prompts of 256 tokens decode 48 tokens each; the median
    time of the last 40 steps, median of three repeats (ms)."""
    from pdserve.core.sampling import SamplingParams

    out = {}
    for b in batches:
        repeats = []
        for rep in range(3):
            params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0)
            for i in range(b):  # distinct prompts: no prefix-cache hits across repeats
                engine.add_request(list(range(100 + 7 * rep + i, 356 + 7 * rep + i)), params)
            times = []
            while engine.has_unfinished():
                started = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - started)
            repeats.append(statistics.median(times[-40:]) * 1000)
        out[b] = statistics.median(repeats)
    return out


def _child(dtype: str, batches: list[int]) -> dict[int, float]:
    from pdserve.engine.llm import LLM

    model = Path.home() / ".cache" / "pdserve" / "models" / "SmolLM2-135M-Instruct"
    return decode_step_ms(LLM(model=str(model), dtype=dtype).engine, batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", default="cpu-ops", choices=sorted(COMPARISONS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(_child(args.dtype, batches)))
        return
    variants = COMPARISONS[args.compare]
    results: dict[str, list[dict[int, float]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for name, env in variants.items():
            done = subprocess.run(
                [sys.executable, "-m", "bench.engine.step_time", "--child", "--dtype", args.dtype]
                + ["--batches", args.batches],
                cwd=ROOT,
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=1800,
                check=True,
            )
            figures = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
            results[name].append(figures)
            print(
                f"round {r + 1} {name}: " + ", ".join(f"B={b} {figures[b]:.2f} ms" for b in batches)
            )
    before, after = variants
    print(f"\n| batch | {before} ms | {after} ms | ratio |\n|---|---|---|---|")
    for b in batches:
        x = statistics.median(f[b] for f in results[before])
        y = statistics.median(f[b] for f in results[after])
        print(f"| {b} | {x:.2f} | {y:.2f} | {x / y:.2f}x |")


if __name__ == "__main__":
    main()
