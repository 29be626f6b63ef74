"""Two checkouts of pdserve served side by side, one at a time: `pdserve up` from each
checkout's own virtualenv, the same `pdserve bench serve` client against both, alternating
A, B for --rounds. What a change to the serving path did to throughput and latency.

    # a checkout of the commit before, with its own virtualenv:
    git worktree add /tmp/base HEAD~1 && python3.11 -m venv /tmp/base/.venv && \\
        /tmp/base/.venv/bin/pip install -c constraints/cpu.txt -e /tmp/base
    .venv/bin/python -m bench.serving.ab_trees --a /tmp/base --b . --rounds 2 \\
        [--concurrency 16 --num-prompts 48 --input-len 256 --output-len 128] [--write-results]

Each checkout's `pdserve up --prefill 1 --decode 1` (dtype auto) runs with its own code
(its `.venv/bin/pdserve`, or --a-venv/--b-venv); the client is this checkout's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from bench import ROOT
from bench.results_md import machine, replace_section
from bench.serving.compare import System
from pdserve.engine.prepare_model import prepare_default_model
from pdserve.local.launcher import Launcher, free_port


def serve_once(tree: Path, venv: Path, model: Path, args, out: Path) -> dict:
    """One `pdserve up` of ``tree`` and one bench run against it: its metrics."""
    system = System(tree.name or "tree", Launcher(out.parent, cwd=tree))
    port = free_port()
    argv = [str(venv / "bin/pdserve"), "up", "--prefill", "1", "--decode", "1", "--port", "0"]
    argv += ["--http-port", str(port), "--model", str(model)]
    try:
        system.start(
            "up", argv, args.startup_timeout, probe_url=f"http://127.0.0.1:{port}/v1/models"
        )
        bench = [str(ROOT / ".venv/bin/pdserve"), "bench", "serve", "--no-progress"]
        bench += ["--base-url", f"http://127.0.0.1:{port}", "--model", model.name]
        bench += ["--tokenizer", str(model), "--workload", "random", "--seed", "0"]
        bench += [
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
        ]
        bench += [
            "--num-prompts",
            str(args.num_prompts),
            "--max-concurrency",
            str(args.concurrency),
        ]
        bench += ["--result-file", str(out)]
        subprocess.run(bench, check=True, cwd=ROOT)
    finally:
        system.stop()
    metrics = json.loads(out.read_text())["metrics"]
    return {
        "tok_s": metrics["output_throughput"],
        "ttft_p50": metrics["ttft_ms"]["p50"],
        "tpot_p50": metrics["tpot_ms"]["p50"],
        "failed": metrics["failed"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    ap.add_argument("--b", type=Path, default=ROOT, help="checkout B (default: this one)")
    ap.add_argument("--a-venv", type=Path, help="A's virtualenv (default: A/.venv)")
    ap.add_argument("--b-venv", type=Path, help="B's virtualenv (default: B/.venv)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--label", default="ab", help="the RESULTS.md section's name")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    model = prepare_default_model(progress=False)
    out = ROOT / "bench/out/ab_trees"
    out.mkdir(parents=True, exist_ok=True)
    trees = {
        "A": (args.a.resolve(), (args.a_venv or args.a / ".venv").resolve()),
        "B": (args.b.resolve(), (args.b_venv or args.b / ".venv").resolve()),
    }
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name, (tree, venv) in trees.items():
            runs[name].append(serve_once(tree, venv, model, args, out / f"{name}-{r}.json"))
            print(name, runs[name][-1], flush=True)
    lines = [
        "| tree | commit | output tok/s | TTFT p50 ms | TPOT p50 ms | failed |",
        "|---|---|---|---|---|---|",
    ]
    for name, (tree, _) in trees.items():
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
        ).stdout.strip()
        med = {
            k: statistics.median(r[k] for r in runs[name])
            for k in ("tok_s", "ttft_p50", "tpot_p50")
        }
        lines.append(
            f"| {name} | {commit} | {med['tok_s']:.1f} | {med['ttft_p50']:.0f} | "
            f"{med['tpot_p50']:.1f} | {sum(r['failed'] for r in runs[name])} |"
        )
    table = "\n".join(lines)
    per_run = "; ".join(
        f"{n}: " + ", ".join(f"{r['tok_s']:.1f}" for r in rs) for n, rs in runs.items()
    )
    print(table)
    if args.write_results:
        body = (
            f"## Serving A/B: {args.label}\n\n"
            f"Machine: {machine()}. `pdserve up --prefill 1 --decode 1` (dtype auto) from each "
            f"checkout, alternating A, B for {args.rounds} rounds; `pdserve bench serve` random "
            f"{args.input_len} -> {args.output_len}, {args.num_prompts} prompts at c"
            f"{args.concurrency}, seed 0; medians (`python -m bench.serving.ab_trees`). "
            f"Per run, output tok/s: {per_run}.\n\n" + table
        )
        replace_section(ROOT / "bench" / "RESULTS.md", f"ab-{args.label}", body)


if __name__ == "__main__":
    main()
