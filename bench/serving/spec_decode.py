"""Where speculation pays: `pdserve bench serve` against `pdserve up` with n-gram speculation
on its decode worker and without.

Starts, side by side, two `pdserve up` clusters (1 prefill + 1 decode worker, SmolLM2,
float32 unless --dtype says otherwise): "off" with no speculation, "on" with
``--speculative-config`` (n-gram, 4 tokens by default). Only one is under load at a time;
for each case (a workload at a concurrency) the runs are interleaved, the order turning
every repeat, and repeat r uses workload seed r on both. The acceptance rate and the mean
acceptance length come from the gateway's `/metrics` (its `spec_decode_*` counters) before
and after each run. Writes bench/RESULTS.md's speculative-decoding section.

    .venv/bin/python -m bench.serving.spec_decode [--repeats 2] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench import ROOT
from bench.results_md import replace_section
from pdserve.core.model import default_model_dir
from pdserve.local.launcher import Launcher, free_port

SECTION = "speculative-decoding"
OUT = ROOT / "bench/out/spec"
PYTHON = sys.executable
# (workload, concurrency, prompts): the two cases first.
CASES = (("rewrite", 1, 8), ("random", 16, 64), ("rewrite", 16, 32), ("random", 1, 6))
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def start_cluster(name: str, model: Path, extra: list[str], args) -> tuple[Launcher, str]:
    port = free_port()
    argv = [PYTHON, "-m", "pdserve.cli", "up", "--prefill", "1", "--decode", "1", "--port", "0"]
    argv += ["--http-port", str(port), "--model", str(model), "--dtype", args.dtype]
    argv += ["--log-dir", str(OUT / name), *extra]
    url = f"http://127.0.0.1:{port}"
    launcher = Launcher(OUT, cwd=ROOT)
    child = launcher.start(name, argv, (), probe=lambda: _get(url + "/v1/models") is not None)
    try:
        launcher.wait_ready([child], args.startup_timeout)
    except BaseException:
        launcher.stop_all(timeout=30)
        raise
    print(f"[{name}] ready at {url}", flush=True)
    return launcher, url


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def spec_counters(url: str) -> dict[str, float]:
    """The gateway's spec_decode_* counters (0 where absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(_get(url + "/metrics") or ""):
        for sample in family.samples:
            short = sample.name.removeprefix("pdserve:spec_decode_").removesuffix("_total")
            if short in values and "position" not in sample.labels:
                values[short] += sample.value
    return values


def bench(url: str, model: Path, case: tuple, seed: int, args, out: Path) -> dict:
    workload, concurrency, prompts = case
    argv = [PYTHON, "-m", "pdserve.cli", "bench", "serve", "--backend", "vllm"]
    argv += ["--base-url", url, "--model", model.name, "--tokenizer", str(model)]
    argv += ["--dataset-name", workload, "--num-prompts", str(prompts)]
    argv += ["--random-input-len", "256", "--random-output-len", "128"]
    argv += ["--rewrite-input-len", str(args.rewrite_input_len)]
    argv += ["--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos"]
    argv += ["--save-result", "--result-filename", str(out), "--no-progress"]
    before = spec_counters(url)
    with open(OUT / "bench.log", "a") as log:
        subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    after = spec_counters(url)
    metrics = json.loads(out.read_text())["metrics"]
    metrics["spec"] = {k: after[k] - before[k] for k in COUNTERS}
    metrics["load"] = os.getloadavg()[0]
    return metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}'
    )
    parser.add_argument("--rewrite-input-len", type=int, default=256)
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between runs")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench.log").write_text("")
    model = default_model_dir()
    extras = {"off": [], "on": ["--speculative-config", args.speculative_config]}
    launchers, urls = [], {}
    runs: dict[str, dict[str, list[dict]]] = {}
    try:
        for name, extra in extras.items():
            launcher, urls[name] = start_cluster(name, model, extra, args)
            launchers.append(launcher)
        for name, url in urls.items():  # first-call costs stay out of the figures
            for case in {(w, 4, 4) for w, _, _ in CASES}:
                bench(url, model, case, 1000, args, OUT / f"{name}-warmup.json")
        for case in CASES:
            key = f"{case[0]} c{case[1]}"
            for r in range(args.repeats):
                for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    time.sleep(args.pause)
                    m = bench(urls[name], model, case, r, args, OUT / f"{name}-{key}-{r}.json")
                    runs.setdefault(key, {}).setdefault(name, []).append(m)
                    print(
                        f"[{name}] {key} repeat {r + 1}: {m['output_throughput']:.1f} tok/s, "
                        f"TPOT p50 {m['tpot_ms']['p50']:.1f} ms, accepted "
                        f"{m['spec']['num_accepted_tokens']:.0f}/"
                        f"{m['spec']['num_draft_tokens']:.0f}",
                        flush=True,
                    )
    finally:
        for launcher in launchers:
            launcher.stop_all(timeout=30)
    (OUT / "runs.json").write_text(json.dumps(runs, indent=1))
    body = report(runs, args)
    print(body)
    if args.write_results:
        replace_section(ROOT / "bench/RESULTS.md", SECTION, body)
    return 0


def report(runs: dict[str, dict[str, list[dict]]], args) -> str:
    def med(ms: list[dict], key: str, sub: str | None = None) -> float:
        return statistics.median(m[key][sub] if sub else m[key] for m in ms)

    loads = [m["load"] for case in runs.values() for ms in case.values() for m in ms]
    lines = [
        "## Speculative decoding (issue 17)",
        "",
        f"`pdserve up` (1 prefill + 1 decode worker, SmolLM2-135M, {args.dtype}), two "
        "clusters side by side, one under load at a time: off (no speculation) and on "
        f"(`--speculative-config '{args.speculative_config}'`). rewrite: repeat a given text "
        f"or code of about {args.rewrite_input_len} tokens (`--workload rewrite`); random: "
        "256 -> 128 random tokens. Runs interleaved, the order turning every repeat; median "
        f"of {args.repeats}. Acceptance from the gateway's `spec_decode_*` counters over "
        "the runs of on.",
        "",
        "| workload | off tok/s | on tok/s | on / off | off TPOT p50 ms | on TPOT p50 ms "
        "| acceptance rate | mean acceptance length |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, by in runs.items():
        off, on = med(by["off"], "output_throughput"), med(by["on"], "output_throughput")
        spec = {k: sum(m["spec"][k] for m in by["on"]) for k in COUNTERS}
        rate = spec["num_accepted_tokens"] / spec["num_draft_tokens"] if spec["num_drafts"] else 0
        length = 1 + spec["num_accepted_tokens"] / spec["num_drafts"] if spec["num_drafts"] else 1
        lines.append(
            f"| {key} | {off:.1f} | {on:.1f} | {on / off:.2f} | "
            f"{med(by['off'], 'tpot_ms', 'p50'):.1f} | {med(by['on'], 'tpot_ms', 'p50'):.1f} | "
            f"{rate:.2f} | {length:.2f} |"
        )
    lines += [
        "",
        "Per run (tok/s): "
        + "; ".join(
            f"{key} {name} " + ", ".join(f"{m['output_throughput']:.1f}" for m in ms)
            for key, by in runs.items()
            for name, ms in by.items()
        )
        + ".",
        "",
        f"Machine load (1-minute average) after the runs: {min(loads):.1f} to "
        f"{max(loads):.1f} on {os.cpu_count()} cores.",
        "",
        "```sh",
        f".venv/bin/python -m bench.serving.spec_decode --repeats {args.repeats} --write-results",
        "```",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
