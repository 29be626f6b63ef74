"""A worker's time to READY (cold and warm compile cache) and resident memory; `pdserve up`'s
time to ready.

    .venv/bin/python -m bench.serving.worker_footprint [--write-results]

- decode worker, default settings (SmolLM2, --dtype auto, default KV budget): started with
  an empty inductor cache (cold: a temporary TORCHINDUCTOR_CACHE_DIR) and then with the
  cache the cold start filled (warm); RSS (VmRSS, and VmHWM, its peak) read at READY and
  after 16 requests of 256 -> 64 tokens through the worker's own gRPC API;
- the same with --enforce-eager, for the memory the compiled step adds;
- `pdserve up` (Redis, kvstore, a prefill and a decode worker, gateway): seconds from
  start to its REST API answering, with an empty compile cache and then with the cache
  that start filled (warm: every worker's compiled steps cached).

The dtype probe's result and the C kernels are cached before the first timed start (they
are per machine, not per start), so the cold figure is the compile alone.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path

from bench import ROOT
from bench.results_md import machine, replace_section
from pdserve.local.launcher import Launcher, free_port

PY = sys.executable


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


async def load(address: str, n: int = 16) -> None:
    """n requests of 256 random tokens -> 64 through the decode worker's Decode stream."""
    import grpc

    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    rng = random.Random(0)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)

        async def one(i: int) -> None:
            request = decode_pb2.DecodeRequest(
                request_id=f"footprint-{i}",
                prompt_token_ids=[rng.randrange(100, 40000) for _ in range(256)],
                params=common_pb2.SamplingParams(max_tokens=64, ignore_eos=True),
            )
            async for _ in stub.Decode(request, timeout=600):
                pass

        await asyncio.gather(*(one(i) for i in range(n)))


def worker(launcher: Launcher, name: str, env: dict[str, str], extra: list[str]) -> dict:
    started = time.monotonic()
    child = launcher.start(
        name, [PY, "-m", "pdserve.cli", "decode", "--port", "0", *extra], ["decode"], env=env
    )
    launcher.wait_ready([child], 900)
    ready = time.monotonic() - started
    at_ready = rss_mib(child.proc.pid)
    asyncio.run(load(child.address))
    after = rss_mib(child.proc.pid)
    launcher.stop([child])
    return {
        "ready_s": round(ready, 1),
        "rss_ready_mib": round(at_ready[0]),
        "rss_after_mib": round(after[0]),
        "peak_mib": round(after[1]),
    }


def up_ready_s(launcher: Launcher, name: str, env: dict[str, str]) -> float:
    port = free_port()
    started = time.monotonic()
    child = launcher.start(
        name, [PY, "-m", "pdserve.cli", "up", "--port", "0", "--http-port", str(port)], env=env
    )
    url = f"http://127.0.0.1:{port}/v1/models"
    while time.monotonic() - started < 600:
        try:
            with urllib.request.urlopen(url, timeout=2):
                break
        except OSError:
            time.sleep(0.5)
    ready = time.monotonic() - started
    launcher.stop([child], 30)
    return round(ready, 1)


def torch_version() -> str:
    """The installed torch's version, without importing it."""
    return importlib.metadata.version("torch")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="pdserve-footprint-"))
    launcher = Launcher(logs, cwd=ROOT)
    cold_cache = tempfile.mkdtemp(prefix="inductor-cold-")
    base = dict(os.environ)
    try:
        # Fill the per-machine caches (probe, kernels) and the default compile cache first.
        worker(launcher, "prime", base, [])
        rows = {
            "cold compile cache": worker(
                launcher, "cold", {**base, "TORCHINDUCTOR_CACHE_DIR": cold_cache}, []
            ),
            "warm compile cache": worker(launcher, "warm", base, []),
            "--enforce-eager": worker(launcher, "eager", base, ["--enforce-eager"]),
        }
        # `up` with an empty compile cache (its prefill and decode workers compile side by
        # side), then again with the cache that run filled.
        up_cold_cache = tempfile.mkdtemp(prefix="inductor-cold-up-")
        up_env = {**base, "TORCHINDUCTOR_CACHE_DIR": up_cold_cache}
        up = {
            "cold": up_ready_s(launcher, "up-cold", up_env),
            "warm": up_ready_s(launcher, "up-warm", up_env),
        }
    finally:
        launcher.stop_all()
    result = {"decode_worker": rows, "up_ready_s": up}
    print(json.dumps(result, indent=1))
    lines = [
        "## Worker start-up and memory",
        "",
        "A decode worker with default settings (SmolLM2-135M-Instruct, `--dtype auto`, the "
        "default 1 GiB KV budget), started alone; RSS at READY and after 16 requests of "
        "256 -> 64 tokens (VmRSS; peak: VmHWM).",
        "",
        f"Machine: {machine()}, torch {torch_version()}, {date.today().isoformat()}.",
        "",
        "| start | READY s | RSS at READY MiB | RSS after load MiB | peak MiB |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['ready_s']} | {r['rss_ready_mib']} | {r['rss_after_mib']} | "
            f"{r['peak_mib']} |"
        )
    lines += [
        "",
        "`pdserve up` (Redis, kvstore, prefill and decode workers, gateway): REST API "
        f"answering after {up['cold']} s with an empty compile cache (its two workers "
        f"compile side by side), {up['warm']} s when started again with the cache that "
        "run filled.",
        "",
        "Command: `.venv/bin/python -m bench.serving.worker_footprint --write-results`",
    ]
    if args.write_results:
        replace_section(ROOT / "bench/RESULTS.md", "worker-footprint", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
