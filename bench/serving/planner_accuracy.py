"""`pdserve plan`'s prediction against `pdserve bench serve`'s measurement (issue 41).

For each request rate: `pdserve plan --json` (the profile, the traffic, the targets, at most
--max-workers workers) recommends a cluster; `pdserve up` starts that cluster (each worker
on --cores-per-worker cores: ``--cpu-layout split``, ``--num-threads``), `pdserve bench
serve` sends the same traffic (random prompts, Poisson arrivals), and the predicted p90
TTFT and ITL are set beside the measured ones. The prediction is for the very arrivals the
benchmark sends (`--seed 0` in both: the same Poisson draws), so that the figures compare
the model of the cluster and not two draws of a queue; the p90 averaged over 5 traces (what
`pdserve plan` prints by default) is beside it. Writes
bench/out/planner_accuracy-PROMPT-OUTPUT.json; ``--predict-only`` predicts again against the
result files of an earlier run.

    .venv/bin/python -m bench.serving.planner_accuracy --profile bench/out/profile-smollm2.json \\
        --rates 0.25 0.5 1.0 --prompt-len 256 --output-len 64 --num-prompts 120
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


def recommend(args, rate: float, runs: int = 1) -> dict:
    """The plan: by default for the very arrivals `pdserve bench serve --seed 0` sends (one
    simulation, seed 0: the same Poisson draws); ``runs`` > 1: pooled over that many seeds,
    the p90 a run of this traffic has on average."""
    argv = [
        *(sys.executable, "-m", "pdserve.cli", "plan", "--profile", str(args.profile), "--json"),
        *("--seed", "0", "--runs", str(runs)),
        *("--request-rate", str(rate), "--prompt-len", str(args.prompt_len)),
        *("--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts)),
        *("--ttft-p90-ms", str(args.ttft_p90_ms), "--itl-p90-ms", str(args.itl_p90_ms)),
        *("--max-workers", str(args.max_workers)),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):
        raise RuntimeError(done.stderr)
    return json.loads(done.stdout)


def measure(args, plan: dict, rate: float, out: Path) -> dict:
    http = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="planner-accuracy-"))
    prefill, decode = plan["prefill_replicas"], plan["decode_replicas"]
    argv = ["--port", "0", "--http-port", str(http)]
    argv += ["--prefill", str(prefill), "--decode", str(decode), "--cpu-layout", "split"]
    argv += ["--num-threads", str(args.cores_per_worker), "--log-dir", str(log_dir)]
    if not plan["disaggregation"]:
        argv += ["--disaggregation", "off"]
    else:
        argv += ["--local-prefill-threshold", str(plan["local_prefill_threshold"])]
    with pdserve_up(argv, f"{rate:g} req/s", timeout_s=600):
        base = ("--base-url", f"http://127.0.0.1:{http}", "--model", args.model)
        # A few requests first, so that the workers' first steps (compilation) are not measured.
        subprocess.run(
            [
                *(sys.executable, "-m", "pdserve.cli", "bench", "serve", *base),
                *("--random-input-len", str(args.prompt_len), "--random-output-len", "8"),
                *("--num-prompts", "4", "--seed", "99", "--no-progress"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        result = out / f"planner-accuracy-{args.prompt_len}-{args.output_len}-{rate:g}.json"
        subprocess.run(
            [
                *(sys.executable, "-m", "pdserve.cli", "bench", "serve", *base),
                *("--random-input-len", str(args.prompt_len)),
                *("--random-output-len", str(args.output_len), "--random-range-ratio", "0"),
                *("--num-prompts", str(args.num_prompts), "--request-rate", str(rate)),
                *("--seed", "0", "--result-file", str(result), "--no-progress"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(result.read_text())["metrics"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=120)
    parser.add_argument("--ttft-p90-ms", type=float, default=2000.0)
    parser.add_argument("--itl-p90-ms", type=float, default=150.0)
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument("--cores-per-worker", type=int, default=1)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument(
        "--predict-only",
        action="store_true",
        help="predict again against the result files of an earlier run (no cluster)",
    )
    args = parser.parse_args(argv)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rate in args.rates:
        plan = recommend(args, rate)
        if args.predict_only:  # the measurement of an earlier run, predicted again
            result = out / f"planner-accuracy-{args.prompt_len}-{args.output_len}-{rate:g}.json"
            metrics = json.loads(result.read_text())["metrics"]
        else:
            metrics = measure(args, plan, rate, out)
        predicted = plan["predicted"]
        average = recommend(args, rate, runs=5)["predicted"]
        row = {
            "rate": rate,
            "cluster": f"{plan['prefill_replicas']}P+{plan['decode_replicas']}D",
            "meets_targets": plan["meets_targets"],
            "predicted_ttft_p90": predicted["ttft_ms"]["p90"],
            "measured_ttft_p90": metrics["ttft_ms"]["p90"],
            "predicted_itl_p90": predicted["itl_ms"]["p90"],
            "measured_itl_p90": metrics["itl_ms"]["p90"],
            "predicted_ttft_p50": predicted["ttft_ms"]["p50"],
            "measured_ttft_p50": metrics["ttft_ms"]["p50"],
            "predicted_itl_p50": predicted["itl_ms"]["p50"],
            "measured_itl_p50": metrics["itl_ms"]["p50"],
            "failed": metrics["failed"],
            "average_ttft_p90": average["ttft_ms"]["p90"],
            "average_itl_p90": average["itl_ms"]["p90"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nmachine: {os.cpu_count()} cores; profile {args.profile.name}")
    print(
        "| req/s | plan | TTFT p90 predicted / measured (ms) | error | "
        "ITL p90 predicted / measured (ms) | error | averaged over 5 traces: TTFT, ITL p90 |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        e_ttft = r["predicted_ttft_p90"] / r["measured_ttft_p90"] - 1
        e_itl = r["predicted_itl_p90"] / r["measured_itl_p90"] - 1
        print(
            f"| {r['rate']:g} | {r['cluster']} | {r['predicted_ttft_p90']:.0f} / "
            f"{r['measured_ttft_p90']:.0f} | {e_ttft:+.1%} | {r['predicted_itl_p90']:.1f} / "
            f"{r['measured_itl_p90']:.1f} | {e_itl:+.1%} | {r['average_ttft_p90']:.0f}, "
            f"{r['average_itl_p90']:.1f} |"
        )
    name = f"planner_accuracy-{args.prompt_len}-{args.output_len}.json"
    (out / name).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
