"""Where the serving processes spend their time under load: py-spy on each of them.

Starts `pdserve up` (1 prefill + 1 decode worker, its defaults), sends the comparison's
workload (random 256 -> 128 tokens) at one concurrency, and once the load is steady
samples every pdserve process with py-spy for --duration seconds. The decode worker's
samples are then grouped by what the engine thread was doing (the custom ops the
compiled step calls, sampling, the rest of the compiled graph) and by thread role
(engine thread, asyncio/gRPC threads). Needs py-spy (`pip install py-spy`) and, for
py-spy to attach, ptrace rights over the children (root, or ptrace_scope 0).

    .venv/bin/python -m bench.serving.profile_serving --concurrency 16 --write-results
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.results_md import replace_section
from bench.serving.compare import System, bench_argv, start_pdserve_disagg, warm_up
from pdserve.core.model import locate_model
from pdserve.local.launcher import Launcher

SECTION = "serving-profile"
ROLES = ("decode", "prefill", "gateway", "kvstore")
# (category, substrings of a frame, any of which puts a sample in it): a sample goes to the
# first category that any frame of its stack matches, so the order is the priority (the op
# a sample is inside before the graph that called it, the engine thread before asyncio).
CATEGORIES = (
    ("linears (pdserve::cpu_linear: AMX / oneDNN GEMMs)", ("cpu_linear.py", "gemm_cpu.py")),
    ("decode attention (pdserve::paged_attention, C kernel)", ("attention_cpu.py",)),
    ("prefill attention (SDPA over the new tokens)", ("attention_ref.py",)),
    ("sampling", ("sampler.py",)),
    ("step inputs (scheduling, buffers)", ("step_inputs.py", "scheduler.py")),
    ("custom-op dispatch (torch.library's Python wrappers)", ("torch/_ops.py", "torch/_library")),
    ("inductor's fused kernels (norms, rope, SiLU, adds)", ("torchinductor", "inductor")),
    ("model runner / engine step", ("model_runner.py", "engine.py")),
    ("gRPC / asyncio (token streaming, KV import)", ("grpc", "asyncio", "server.py")),
)


def descendants(pid: int) -> list[int]:
    """PIDs below ``pid`` in the process tree, from /proc."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children[ppid].append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def role_pids(root: int) -> dict[str, int]:
    """The pdserve service processes under ``root``, by role (`pdserve.cli ROLE ...`)."""
    found: dict[str, int] = {}
    for pid in descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv]
        if "pdserve.cli" in words:
            role = words[words.index("pdserve.cli") + 1]
            if role in ROLES:
                found.setdefault(role, pid)
    return found


def classify(stack: str) -> str:
    for name, needles in CATEGORIES:
        if any(n in stack for n in needles):
            return name
    return "other"


def read_raw(path: Path) -> list[tuple[str, int]]:
    rows = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            rows.append((stack, int(count)))
    return rows


def summarize(role: str, rows: list[tuple[str, int]], duration: float, rate: int) -> list[str]:
    total = sum(c for _, c in rows)
    lines = [f"**{role}**: {total} samples with a thread running in {duration:.0f} s at {rate} Hz"]
    if not total:
        return lines
    by_cat: collections.Counter[str] = collections.Counter()
    for stack, count in rows:
        by_cat[classify(stack)] += count
    lines += ["", "| where | share |", "|---|---|"]
    lines += [f"| {name} | {100 * n / total:.0f}% |" for name, n in by_cat.most_common()]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="default: 6 x concurrency, at least 16"
    )
    parser.add_argument("--settle", type=float, default=15.0, help="seconds of load first")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=50)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    args.num_prompts = args.num_prompts or max(16, 6 * args.concurrency)
    if shutil.which("py-spy") is None and not (ROOT / ".venv/bin/py-spy").exists():
        parser.error("py-spy is not installed: pip install py-spy")
    pyspy = shutil.which("py-spy") or str(ROOT / ".venv/bin/py-spy")
    model = locate_model(str(args.model) if args.model else None)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-profile-"))
    system = System("profile", Launcher(tmp / "logs", cwd=ROOT))
    started: list[subprocess.Popen] = []  # the load and the samplers, ended if still running
    try:
        url = start_pdserve_disagg(system, model, timeout=300)
        warm_up(url, model, tmp / "warmup.log")
        up_pid = system.launcher.children[0].proc.pid
        pids = role_pids(up_pid)
        flags = {
            "--random-input-len": 256,
            "--random-output-len": 128,
            "--num-prompts": args.num_prompts,
            "--max-concurrency": args.concurrency,
            "--seed": 0,
        }
        with open(tmp / "load.log", "w") as load_log:
            load = subprocess.Popen(
                bench_argv("serve", url, model, flags),
                cwd=ROOT,
                stdout=load_log,
                stderr=subprocess.STDOUT,
            )
        started.append(load)
        time.sleep(args.settle)
        spies = {
            role: subprocess.Popen(
                [pyspy, "record", "-p", str(pid), "-d", str(int(args.duration))]
                + ["-r", str(args.rate), "-f", "raw", "-o", str(tmp / f"{role}.txt")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for role, pid in pids.items()
        }
        started += spies.values()
        for spy in spies.values():
            spy.wait(timeout=args.duration + 60)
        still_loading = load.poll() is None
        load.wait(timeout=900)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        system.stop()
    lines = [
        f"`pdserve up` (1 prefill + 1 decode worker, defaults), {args.num_prompts} prompts "
        f"random 256 -> 128 at c{args.concurrency}; after {args.settle:.0f} s of load each "
        f"process sampled {args.duration:.0f} s at {args.rate} Hz "
        f"(`py-spy record -f raw`; idle threads not counted)"
        + ("" if still_loading else " **(the load ended before sampling did)**")
        + ".",
        "",
        f"Command: `.venv/bin/python -m bench.serving.profile_serving --concurrency {args.concurrency}`",
    ]
    for role in ROLES:
        path = tmp / f"{role}.txt"
        if path.exists():
            lines += [""] + summarize(role, read_raw(path), args.duration, args.rate)
    text = "\n".join(lines)
    print(text)
    print(f"raw profiles: {tmp}", file=sys.stderr)
    if args.write_results:
        replace_section(
            ROOT / "bench/RESULTS.md", SECTION, "## Profile of the serving processes\n\n" + text
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
