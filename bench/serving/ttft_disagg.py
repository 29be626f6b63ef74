"""TTFT at concurrency 1, disaggregated against colocated, the prefill given the same cores.

Three clusters of ``pdserve up`` in turn, each on all of this machine's cores
(``--cpu-layout shared``: the prefill worker, or the colocated decode worker, has every
core while it prefills, as the others idle at c1):

- colocated: ``--disaggregation off --prefill 0``;
- disaggregated over gRPC: ``--kv-transport grpc`` (the prefill worker pushes its blocks to
  the kvstore before it answers);
- disaggregated over NIXL: ``--kv-transport nixl`` (it stages them and answers; the decode
  worker reads them from its memory).

Each gets the same random prompts of each length (``pdserve bench serve``, the random
workload, a few output tokens) one at a time; the table has TTFT medians and the
disaggregated / colocated ratios. Writes bench/out/ttft_disagg.json.

    .venv/bin/python -m bench.serving.ttft_disagg --lengths 512 2048 4096 --num-prompts 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.serving.up_cluster import pdserve_up
from pdserve.local.launcher import free_port

MODES = {
    "colocated": ["--disaggregation", "off", "--prefill", "0"],
    "disagg-grpc": ["--kv-transport", "grpc"],
    "disagg-nixl": ["--kv-transport", "nixl"],
}


def run_mode(name: str, flags: list[str], args, out: Path) -> dict[int, float]:
    http = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix=f"ttft-{name}-"))
    argv = ["--port", "0", "--http-port", str(http)]
    argv += ["--cpu-layout", "shared", "--max-model-len", str(max(args.lengths) + 64)]
    argv += ["--log-dir", str(log_dir), *flags, *args.up_args]
    with pdserve_up(argv, name):
        ttft = {}
        for length in args.lengths:
            result = out / f"ttft-{name}-{length}.json"
            subprocess.run(
                [
                    *(sys.executable, "-m", "pdserve.cli", "bench", "serve"),
                    *("--base-url", f"http://127.0.0.1:{http}", "--model", args.model),
                    *("--workload", "random", "--random-input-len", str(length)),
                    *("--random-output-len", str(args.output_len), "--random-range-ratio", "0"),
                    *("--num-prompts", str(args.num_prompts + 1), "--max-concurrency", "1"),
                    *("--seed", "7", "--result-file", str(result)),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            report = json.loads(result.read_text())
            # The first request of each length warms the workers' shapes: left out.
            values = sorted(r["ttft"] * 1000 for r in report["requests"][1:] if r.get("ttft"))
            ttft[length] = values[len(values) // 2]
            print(f"{name} {length}: TTFT p50 {ttft[length]:.0f} ms", flush=True)
        return ttft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--up-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    results = {mode: run_mode(mode, MODES[mode], args, out) for mode in args.modes}
    print(f"\nmachine: {os.cpu_count()} cores; TTFT p50 at c1, ms ({args.num_prompts} prompts)")
    print(
        "| prompt tokens | "
        + " | ".join(args.modes)
        + " | "
        + " | ".join(f"{m} / colocated" for m in args.modes if m != "colocated")
        + " |"
    )
    print("|---" * (1 + len(args.modes) + len(args.modes) - 1) + "|")
    for length in args.lengths:
        cells = [f"{results[m][length]:.0f}" for m in args.modes]
        ratios = [
            f"{results[m][length] / results['colocated'][length]:.3f}"
            for m in args.modes
            if m != "colocated" and "colocated" in results
        ]
        print(f"| {length} | " + " | ".join(cells + ratios) + " |")
    (out / "ttft_disagg.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
