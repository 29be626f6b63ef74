"""A longer chaos run: random faults under bounded load on a local cluster.

The ChaosCluster of pdserve.testing.chaos (2 prefill workers, 2 decode workers, 2 kvstore
replicas, Redis, a gateway; each its own process on 127.0.0.1) serves ``--concurrency``
clients that send completions without pause, cycling through a fixed set of seeded jobs
(greedy and sampled, streamed and not, three lengths). Every ``--fault-interval`` seconds
one of the five faults, drawn at random, is made (a decode worker SIGKILLed under live
streams or SIGSTOPped past the stream idle timeout, a prefill worker, a kvstore replica or
Redis SIGKILLed) and followed by the restart a supervisor would make. After ``--duration``
seconds the load stops, and one line sums it up: requests, failures (an error, or output
other than the fault-free engine's), migrations, and the p99 added latency of a migrated
request: its latency minus the median latency of the unbroken requests of its length.

    .venv/bin/python -m bench.serving.chaos --duration 300 --write-results
    .venv/bin/python -m bench.serving.chaos --model ~/.cache/pdserve/models/SmolLM2-135M-Instruct \
        --step-delay 0 --idle-timeout 30

The default model is a tiny random Llama whose steps are slowed to a real model's pace
(``--step-delay``, the test-only PDSERVE_TEST_FAULT), so that faults land on live streams
and a migration's recompute is quick. With a real model on a CPU, the idle timeout must
outlast the recompute of the streams a fault moves at once, or a moved stream is counted
as stalled again.

Every process it starts it stops (by PID, through the launcher), also on Ctrl-C or SIGTERM.
The services' logs and a result.json go to bench/out/chaos/<date-time>/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

from bench import ROOT
from bench.results_md import replace_section
from pdserve.testing.chaos import (
    ENGINE,
    FAULTS,
    ChaosCluster,
    Load,
    Outcome,
    decode_moves,
    make_jobs,
    reference_tokens,
    repeated,
    routes,
)
from pdserve.testing.metrics import metric

NUM_JOBS = 64  # distinct jobs, cycled
LENGTHS = (64, 128, 192)
REASONS = ("unavailable", "stalled", "error")
OUT = ROOT / "bench/out/chaos"  # one folder of service logs (and result.json) per run


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


_MOVE = re.compile(r"request (\S+): decode stream on \S+ broke after \d+ tokens \((\w+):")
_CLIENT = re.compile(r"request (\S+) \(client id '([^']+)'\)")


def move_reasons(gateway_log: str) -> dict[str, list[str]]:
    """Why each moved request moved (client id -> reasons, in order), from the gateway's
    warnings (by its own request id) and its per-request lines (which name both ids)."""
    client_of = dict(_CLIENT.findall(gateway_log))
    out: dict[str, list[str]] = {}
    for gateway_id, reason in _MOVE.findall(gateway_log):
        if gateway_id in client_of:
            out.setdefault(client_of[gateway_id], []).append(reason)
    return out


def added_latencies(outcomes: list[Outcome], moved: set[str]) -> list[float]:
    """For each successful request in ``moved``: its latency minus the median latency of the
    unbroken successful requests of the same length."""
    unbroken: dict[int, list[float]] = {}
    for o in outcomes:
        if o.error is None and o.job.name not in moved:
            unbroken.setdefault(o.job.max_tokens, []).append(o.latency_s)
    medians = {n: statistics.median(v) for n, v in unbroken.items()}
    return [
        o.latency_s - medians[o.job.max_tokens]
        for o in outcomes
        if o.error is None and o.job.name in moved and o.job.max_tokens in medians
    ]


async def run(args: argparse.Namespace, model: Path, log_dir: Path) -> dict:
    rng = random.Random(args.seed)
    jobs = make_jobs(NUM_JOBS, args.seed, LENGTHS)
    print(f"reference: {len(jobs)} jobs on an in-process engine", flush=True)
    want = await asyncio.to_thread(reference_tokens, model, jobs)
    env = (
        {"PDSERVE_TEST_FAULT": f"engine-step-delay:{args.step_delay:g}"}
        if args.step_delay
        else None
    )
    chaos = ChaosCluster(
        model, log_dir, "chaos", ENGINE, args.idle_timeout, args.registry_ttl, worker_env=env
    )
    t0 = time.monotonic()
    async with chaos:
        print(f"cluster up in {time.monotonic() - t0:.0f} s; logs in {log_dir}", flush=True)
        load = Load(chaos.url, "chaos", args.concurrency)
        async with load.running(repeated(jobs)) as running:
            start = time.monotonic()
            end = start + args.duration
            k = 1  # the k-th fault is due k intervals in; one that recovers late delays the next
            while start + k * args.fault_interval < end:
                await asyncio.sleep(max(0.0, start + k * args.fault_interval - time.monotonic()))
                kind = rng.choice(FAULTS)
                fault = await asyncio.wait_for(chaos.hit(kind), 180)
                print(
                    f"{fault.at - start:6.0f} s  {kind:12} {fault.victim:9} load {fault.load:2}"
                    f"  whole again in {fault.recovered_s:4.1f} s; {len(load.outcomes)} "
                    "requests done",
                    flush=True,
                )
                k += 1
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            load.stop.set()
            outcomes = await asyncio.wait_for(running, 300)
        elapsed = time.monotonic() - start
        await chaos.idle(60)
        migrations = {
            r: metric(chaos.url, "pdserve:stream_migrations_total", reason=r) for r in REASONS
        }
        gateway_log = chaos.gateway.log_text()
        load_average = os.getloadavg()

    seen, why = routes(gateway_log), move_reasons(gateway_log)
    errors = [o for o in outcomes if o.error is not None]
    wrong = [o for o in outcomes if o.error is None and o.tokens != want[o.job.base]]
    moved = {name for name, route in seen.items() if decode_moves(route)}
    added = added_latencies(outcomes, moved)
    log_moves = sum(len(decode_moves(route)) for route in seen.values())
    # The requests that moved for one reason only, to tell a kill's cost from a freeze's.
    only = {
        reason: added_latencies(outcomes, {n for n, rs in why.items() if set(rs) == {reason}})
        for reason in ("unavailable", "stalled")
    }
    return {
        "requests": len(outcomes),
        "errors": len(errors),
        "wrong": len(wrong),
        "first_error": errors[0].error if errors else "",
        "migrations": migrations,
        "log_moves": log_moves,
        "moved_requests": len(moved),
        "added_p50": statistics.median(added) if added else None,
        "added_p99": percentile(added, 0.99) if added else None,
        "added_by_reason": {
            r: (len(v), statistics.median(v), percentile(v, 0.99)) for r, v in only.items() if v
        },
        "faults": Counter(f.kind for f in chaos.faults),
        "recovered_max": {
            k: max(f.recovered_s for f in chaos.faults if f.kind == k)
            for k in FAULTS
            if any(f.kind == k for f in chaos.faults)
        },
        "elapsed_s": elapsed,
        "load_average": load_average,
    }


def summary(r: dict) -> str:
    migrations = sum(r["migrations"].values())
    reasons = ", ".join(f"{k} {v:g}" for k, v in r["migrations"].items() if v)
    p99 = "n/a" if r["added_p99"] is None else f"{r['added_p99']:.2f} s"
    return (
        f"chaos: {r['requests']} requests, {r['errors'] + r['wrong']} failures, "
        f"{migrations:g} migrations ({reasons or 'none'}), {sum(r['faults'].values())} faults; "
        f"p99 added latency of a migrated stream {p99}"
    )


def results_section(r: dict, args: argparse.Namespace, model: Path, line: str) -> str:
    pace = f", engine steps slowed by {args.step_delay:g} s each" if args.step_delay else ""
    setup = (
        f"{datetime.date.today().isoformat()}, this machine. A local cluster of "
        f"separate processes (2 prefill, 2 decode, 2 kvstore replicas, Redis, a gateway; model "
        f"`{model.name}`, float32, one torch thread per worker{pace}; "
        f"`--stream-idle-timeout {args.idle_timeout:g}`, `--registry-ttl "
        f"{args.registry_ttl:g}`), {args.concurrency} clients sending completions without "
        f"pause for {args.duration:g} s (greedy and seeded, streamed and not, {LENGTHS[0]} to "
        f"{LENGTHS[-1]} tokens; {r['requests'] / r['elapsed_s']:.2f} requests/s), a random "
        f"fault every {args.fault_interval:g} s, each followed by the restart a supervisor "
        "would make. A failure is an error or an output other than the fault-free engine's. "
        "The machine is shared: its load average (1, 5, 15 minutes) at the end of the run was "
        + ", ".join(f"{x:.1f}" for x in r["load_average"])
        + f" on {os.cpu_count()} cores."
    )
    faults = "\n".join(
        f"| {k} | {r['faults'].get(k, 0)} | "
        + (f"{r['recovered_max'][k]:.1f}" if k in r["recovered_max"] else "-")
        + " |"
        for k in FAULTS
    )
    names = {"unavailable": "its worker killed", "stalled": "its worker frozen"}
    added = "\n".join(
        f"| {names[k]} | {n} | {p50:.2f} | {p99:.2f} |"
        for k, (n, p50, p99) in r["added_by_reason"].items()
    )
    counted = "equal to" if r["log_moves"] == sum(r["migrations"].values()) else "NOT equal to"
    moves = (
        f"{r['moved_requests']} requests moved, {r['log_moves']} moves in all by the gateway's "
        f"log, {counted} its migration counter. Added latency: a moved request's latency "
        "minus the median of the unbroken requests of its length (streamed or not), for the "
        "requests that moved for one reason only; a frozen worker's streams wait out the idle "
        "timeout first, then both recompute the prompt and the tokens so far."
    )
    command = (
        f".venv/bin/python -m bench.serving.chaos --duration {args.duration:g} --concurrency "
        f"{args.concurrency} --fault-interval {args.fault_interval:g} --seed {args.seed}"
        + (f" --model {args.model}" if args.model else "")
        + (f" --step-delay {args.step_delay:g}" if args.step_delay != 0.03 else "")
        + (f" --idle-timeout {args.idle_timeout:g}" if args.idle_timeout != 3.0 else "")
        + " --write-results"
    )
    return f"""## Chaos: random faults under load

{textwrap.fill(setup, 90)}

    {line}

| fault | times | slowest until the cluster was whole again, s |
|---|---|---|
{faults}

| request moved with | requests | added latency p50, s | p99, s |
|---|---|---|---|
{added}

{textwrap.fill(moves, 90)}

Command: `{command}`"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=8, help="clients at once")
    ap.add_argument("--fault-interval", type=float, default=20.0, help="seconds between faults")
    ap.add_argument("--seed", type=int, default=15, help="seed of the jobs and the faults")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random Llama)")
    ap.add_argument(
        "--step-delay",
        type=float,
        default=0.03,
        help="seconds added to every engine step (the test-only PDSERVE_TEST_FAULT), so that "
        "the tiny model's streams last seconds; 0: none",
    )
    ap.add_argument("--idle-timeout", type=float, default=3.0, help="--stream-idle-timeout")
    ap.add_argument("--registry-ttl", type=float, default=2.0, help="--registry-ttl")
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    if args.fault_interval <= 0 or args.duration < args.fault_interval:
        ap.error("--duration must be at least one --fault-interval, and both positive")
    logging.basicConfig(level=logging.ERROR)
    log_dir = OUT / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        if args.model:
            model = Path(args.model).expanduser()
        else:
            from pdserve.testing.tiny_models import build_tiny_checkpoint

            model = build_tiny_checkpoint("llama", Path(tmp) / "tiny-llama")

        async def guarded() -> dict:
            task = asyncio.current_task()
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
            return await run(args, model, log_dir)

        result = asyncio.run(guarded())
    line = summary(result)
    (log_dir / "result.json").write_text(json.dumps({**result, "line": line}, indent=1))
    print(line)
    if result["first_error"]:
        print(f"first error: {result['first_error']}")
    if args.write_results:
        section = results_section(result, args, model, line)
        replace_section(ROOT / "bench/RESULTS.md", "chaos", section)
    return 0 if result["errors"] + result["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
