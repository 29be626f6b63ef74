"""`pdserve up`'s core layouts side by side: split, shared, decode-first, and colocated.

    .venv/bin/python -m bench.serving.cpu_layouts [--layouts split,shared,decode-first,colocated]

Each layout is started alone (`pdserve up --cpu-layout X`, 1 prefill + 1 decode worker,
`--dtype auto`; colocated: `--disaggregation off --prefill 0`), warmed up, then measured
with `pdserve bench serve`, random 256 -> 128 tokens, seed 0: 12 prompts at concurrency 1
and 64 at 16. Prints one row per layout (output tok/s, TPOT and TTFT p50) and writes
bench/out/cpu_layouts/<layout>-c<N>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT
from bench.serving import compare
from pdserve.core.model import locate_model
from pdserve.local.launcher import Launcher, free_port

LAYOUTS = {
    "split": ["--cpu-layout", "split"],
    "shared": ["--cpu-layout", "shared"],
    "decode-first": ["--cpu-layout", "decode-first"],
    "colocated": ["--disaggregation", "off", "--prefill", "0"],
}
RUNS = ((1, 12), (16, 64))  # (concurrency, prompts)
OUT = ROOT / "bench/out/cpu_layouts"


def run_layout(name: str, model: Path) -> list[str]:
    system = compare.System(name, Launcher(OUT / "logs", cwd=ROOT))
    rows = []
    try:
        port = free_port()
        argv = [compare.PDSERVE, "up", "--port", "0", "--http-port", str(port)]
        argv += ["--model", str(model), *LAYOUTS[name]]
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        system.start("up", argv, 600, probe_url=url + "/v1/models")
        print(f"[{name}] ready after {time.monotonic() - started:.1f} s", flush=True)
        log = OUT / "logs" / f"{name}-bench.log"
        compare.warm_up(url, model, log)
        cells = []
        for concurrency, prompts in RUNS:
            result = OUT / f"{name}-c{concurrency}.json"
            flags = {"--random-input-len": 256, "--random-output-len": 128, "--seed": 0}
            flags |= {"--num-prompts": prompts, "--max-concurrency": concurrency}
            bench = compare.bench_argv("serve", url, model, {**flags, "--result-file": result})
            with open(log, "a") as out:
                subprocess.run(bench, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
            m = json.loads(result.read_text())["metrics"]
            cells.append(
                f"{m['output_throughput']:.1f} | {m['tpot_ms']['p50']:.1f} | "
                f"{m['ttft_ms']['p50']:.0f}"
            )
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    finally:
        system.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args(argv)
    names = args.layouts.split(",")
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        ap.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    model = locate_model(None)
    rows = [row for name in names for row in run_layout(name, model)]
    print(
        "| layout | c1 tok/s | c1 TPOT p50 ms | c1 TTFT p50 ms | c16 tok/s | c16 TPOT p50 ms "
        "| c16 TTFT p50 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
