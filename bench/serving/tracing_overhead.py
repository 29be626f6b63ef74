"""What tracing costs: `pdserve bench serve` at c16 against clusters with tracing off and on.

Starts, side by side, `pdserve up` (1 prefill + 1 decode worker, its defaults, SmolLM2)
with tracing off, one with every request traced (--trace-sample-ratio 1.0) to an OTLP/gRPC
receiver this script runs, and, with --base REV, one running the code of that git revision
(before tracing and metrics existed). Only one cluster is under load at a time; the runs
are interleaved (the order turns every repeat) so that the machine's noise falls on all
alike, and repeat r uses workload seed r on every cluster. The command line is vLLM's
(`vllm bench serve` flag names). Writes bench/RESULTS.md's tracing-overhead section.

    .venv/bin/python -m bench.serving.tracing_overhead [--repeats 2] [--base REV] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.results_md import replace_section
from pdserve.core.model import default_model_dir
from pdserve.local.launcher import Launcher, free_port
from pdserve.testing.otlp_collector import OtlpCollector

SECTION = "tracing-overhead"
OUT = ROOT / "bench/out/tracing"
PYTHON = sys.executable


def source_tree(rev: str, into: Path) -> Path:
    """The files of git revision ``rev`` under ``into`` (git archive: the repository and
    its worktrees are left as they are)."""
    archive = into / "base.tar"
    subprocess.run(["git", "archive", "-o", str(archive), rev], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def start_cluster(
    name: str, tree: Path, model: Path, extra: list[str], timeout: float
) -> tuple[Launcher, str]:
    """`pdserve up` from ``tree`` (python -m pdserve.cli: that tree's code, its children
    too); its launcher and REST base URL once it serves."""
    port = free_port()
    argv = [PYTHON, "-m", "pdserve.cli", "up", "--prefill", "1", "--decode", "1", "--port", "0"]
    argv += ["--http-port", str(port), "--model", str(model), "--log-dir", str(OUT / name)]
    url = f"http://127.0.0.1:{port}"
    launcher = Launcher(OUT, cwd=tree)
    child = launcher.start(name, [*argv, *extra], (), probe=lambda: _serves(url))
    try:
        launcher.wait_ready([child], timeout)
    except BaseException:
        launcher.stop_all(timeout=30)
        raise
    print(f"[{name}] ready at {url}", flush=True)
    return launcher, url


def _serves(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def bench(url: str, model: Path, seed: int, args: argparse.Namespace, out: Path) -> dict:
    """One `pdserve bench serve` run, written as vLLM's users write it; its metrics."""
    argv = [PYTHON, "-m", "pdserve.cli", "bench", "serve", "--backend", "vllm"]
    argv += ["--base-url", url, "--model", model.name, "--tokenizer", str(model)]
    argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    argv += ["--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts)]
    argv += ["--max-concurrency", str(args.concurrency), "--seed", str(seed), "--ignore-eos"]
    argv += ["--save-result", "--result-filename", str(out), "--no-progress"]
    with open(OUT / "bench.log", "a") as log:
        subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads(out.read_text())["metrics"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--base", default=None, help="also run this git revision's code")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--pause", type=float, default=8.0, help="seconds between runs (the last spans leave)"
    )
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench.log").write_text("")
    model = default_model_dir()
    collector = OtlpCollector()
    launchers: list[Launcher] = []
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-base-") as tmp:
        trees = {"off": ROOT, "on": ROOT}
        extras = {"off": [], "on": ["--otlp-traces-endpoint", collector.endpoint]}
        extras["on"] += ["--trace-sample-ratio", "1.0"]
        if args.base:
            trees["base"], extras["base"] = source_tree(args.base, Path(tmp)), []
        try:
            urls = {}
            for name, tree in trees.items():
                launcher, urls[name] = start_cluster(
                    name, tree, model, extras[name], args.startup_timeout
                )
                launchers.append(launcher)
            for name, url in urls.items():  # first-call costs stay out of the figures
                bench(url, model, 1000, argparse.Namespace(**{**vars(args), "num_prompts": 8}),
                      OUT / f"{name}-warmup.json")  # fmt: skip
            order = list(urls)
            for r in range(args.repeats):
                for name in order if r % 2 == 0 else order[::-1]:
                    time.sleep(args.pause)
                    spans_before = len(collector.spans)
                    began = time.monotonic()
                    metrics = bench(urls[name], model, r, args, OUT / f"{name}-r{r + 1}.json")
                    time.sleep(args.pause)  # the run's spans arrive (every 5 s by default)
                    metrics["spans"] = len(collector.spans) - spans_before
                    metrics["load"] = os.getloadavg()[0]
                    runs.setdefault(name, []).append(metrics)
                    print(
                        f"[{name}] repeat {r + 1}: {metrics['output_throughput']:.1f} tok/s, "
                        f"TTFT p50 {metrics['ttft_ms']['p50']:.0f} ms, TPOT p50 "
                        f"{metrics['tpot_ms']['p50']:.1f} ms ({time.monotonic() - began:.0f} s)",
                        flush=True,
                    )
        finally:
            for launcher in launchers:
                launcher.stop_all(timeout=30)
            collector.stop()
    body = report(runs, args)
    print(body)
    (OUT / "runs.json").write_text(json.dumps(runs, indent=1))
    if args.write_results:
        replace_section(ROOT / "bench/RESULTS.md", SECTION, body)
    return 0


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> str:
    """The RESULTS.md section: per run, medians, and on against off."""

    loads = [m["load"] for ms in runs.values() for m in ms]

    def med(name: str, key: str, sub: str | None = None) -> float:
        return statistics.median(m[key][sub] if sub else m[key] for m in runs[name])

    lines = [
        "## Tracing overhead (issue 16)",
        "",
        f"`pdserve up` (1 prefill + 1 decode worker, SmolLM2-135M, defaults), random "
        f"{args.input_len} -> {args.output_len} tokens, {args.num_prompts} prompts at c"
        f"{args.concurrency}; the clusters ran side by side, one under load at a time, the "
        f"runs interleaved, {args.pause:g} s apart; median of {args.repeats} (repeat r: "
        "workload seed r on each). "
        "on: every request traced (`--otlp-traces-endpoint` to an OTLP/gRPC receiver in the "
        "script, `--trace-sample-ratio 1.0`); off: no endpoint"
        + ("; base: the code before tracing and metrics." if "base" in runs else "."),
        "",
        "| cluster | output tok/s (runs) | median | TTFT p50 ms | TPOT p50 ms | spans per run |",
        "|---|---|---|---|---|---|",
    ]
    for name in runs:
        per_run = ", ".join(f"{m['output_throughput']:.1f}" for m in runs[name])
        lines.append(
            f"| {name} | {per_run} | {med(name, 'output_throughput'):.1f} | "
            f"{med(name, 'ttft_ms', 'p50'):.0f} | {med(name, 'tpot_ms', 'p50'):.1f} | "
            f"{statistics.median(m['spans'] for m in runs[name]):.0f} |"
        )
    on, off = med("on", "output_throughput"), med("off", "output_throughput")
    lines += [
        "",
        f"Tracing on / off, output throughput: {on / off:.3f} ({100 * (on / off - 1):+.1f}%).",
    ]
    if "base" in runs:
        base = med("base", "output_throughput")
        lines.append(f"Off / base: {off / base:.3f} ({100 * (off / base - 1):+.1f}%).")
    lines += [
        "",
        f"The machine is shared: its 1-minute load average after the runs was "
        f"{min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores.",
        "",
        f"Command: `.venv/bin/python -m bench.serving.tracing_overhead --repeats {args.repeats}"
        + (f" --base {args.base}" if "base" in runs else "")
        + " --write-results`; run "
        + time.strftime("%Y-%m-%d")
        + ".",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
