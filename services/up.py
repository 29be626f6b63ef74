"""`pdserve up`: Redis, a kvstore, prefill and decode workers and the gateway on this machine.

Workers load their models in parallel, each pinned to its own slice of the CPUs (DESIGN,
"Deployment"); the gateway starts once they are registered, so its first request has
somewhere to go. Ctrl-C stops everything in order: gateway, workers, kvstore, Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from services.common.env import env_default
from services.common.registry import add_redis_args
from services.engine.config import EngineArgs
from services.supervisor import Child, Supervisor, child_setup, cpu_slices, poll_ready

_STOP_TIMEOUT_S = 15.0
_PROGRESS_EVERY_S = 5.0


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while starting."""


@dataclass(frozen=True)
class UpSettings:
    """What `pdserve up` starts, and how."""

    num_prefill: int
    num_decode: int
    disaggregation: bool
    port: int
    http_port: int
    redis_url: str | None
    redis_port: int
    redis_prefix: str
    kvstore_capacity: str
    local_prefill_threshold: int
    log_dir: Path | None
    startup_timeout_s: float
    model: str  # a resolved checkpoint directory
    max_model_len: int | None
    num_threads: int | None  # None: each engine gets as many threads as its cores
    engine_flags: tuple[str, ...]  # the user's engine flags, minus --model / --num-threads

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.num_decode >= 1, f"--decode must be 1 or more, got {self.num_decode}")
        need(self.num_prefill >= 0, f"--prefill must be 0 or more, got {self.num_prefill}")
        need(
            self.num_prefill >= 1 or not self.disaggregation,
            "--disaggregation on needs a prefill worker: pass --prefill 1 or more, or "
            "--disaggregation off",
        )
        for flag, port in (("--port", self.port), ("--redis-port", self.redis_port)):
            need(0 <= port <= 65535, f"{flag} must be between 0 and 65535, got {port}")
        need(-1 <= self.http_port <= 65535, f"--http-port must be -1 to 65535: {self.http_port}")
        need(self.startup_timeout_s > 0, "--startup-timeout must be a positive number of seconds")


def add_up_args(parser: argparse.ArgumentParser) -> None:
    """`pdserve up`'s own flags (the engine flags are added beside them)."""
    add = parser.add_argument
    add("--prefill", type=int, default=None, help="prefill workers (default: 1; 0 with off)")
    add("--decode", type=int, default=1, help="decode workers")
    add(
        "--disaggregation",
        choices=["on", "off"],
        default=env_default("disaggregation", "on"),
        help="on: prefill workers prefill and hand the KV cache to decode workers through the "
        "kvstore; off: decode workers do both (no prefill workers, no kvstore)",
    )
    add("--port", type=int, default=50051, help="the gateway's gRPC port; 0: any free port")
    add("--http-port", type=int, default=8000, help="the OpenAI REST port; 0: any free one")
    add_redis_args(parser, "use this running Redis instead of starting one")
    add("--redis-port", type=int, default=0, help="port of the Redis started here; 0: any free")
    add("--kvstore-capacity", default="2GiB", help="memory of the kvstore for KV blocks")
    add(
        "--local-prefill-threshold",
        type=int,
        default=0,
        help="prompts with fewer uncached tokens than this are prefilled on the decode worker",
    )
    add("--log-dir", type=Path, default=None, help="service logs (default: a new temp dir)")
    add(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds every service gets to become ready",
    )


def settings_from(ns: argparse.Namespace) -> UpSettings:
    """Settings from parsed flags; ValueError / FileNotFoundError say what to change."""
    from services.engine.cli_args import engine_args_from
    from services.engine.prepare_model import resolve_model

    args = engine_args_from(ns)  # refuses a bad engine flag before anything starts
    disaggregation = ns.disaggregation == "on"
    num_prefill = ns.prefill if ns.prefill is not None else int(disaggregation)
    return UpSettings(
        num_prefill=num_prefill,
        num_decode=ns.decode,
        disaggregation=disaggregation,
        port=ns.port,
        http_port=ns.http_port,
        redis_url=ns.redis_url,
        redis_port=ns.redis_port,
        redis_prefix=ns.redis_prefix,
        kvstore_capacity=ns.kvstore_capacity,
        local_prefill_threshold=ns.local_prefill_threshold,
        log_dir=ns.log_dir,
        startup_timeout_s=ns.startup_timeout,
        # Resolved once here: workers racing to prepare the default model would collide.
        model=str(resolve_model(args.model)),
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        engine_flags=tuple(_engine_flags(args)),
    )


def _engine_flags(args: EngineArgs) -> list[str]:
    """The flags that give a worker the same EngineArgs (defaults left out)."""
    out = []
    for f in fields(EngineArgs):
        value = getattr(args, f.name)
        default = None if f.default is MISSING else f.default
        if f.name in ("model", "num_threads") or value is None or value == default:
            continue
        flag = f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            out += [f"--{flag}", str(value)]
    return out


def run(settings: UpSettings) -> int:
    """Start the cluster, wait for Ctrl-C or SIGTERM, stop it; the exit code."""
    stop_signal: list[int] = []

    def on_signal(signum, _frame) -> None:
        stop_signal.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    supervisor = Supervisor(log_dir, env)
    redis = None
    try:
        print(f"pdserve up: logs in {log_dir}", flush=True)
        redis_url = settings.redis_url
        if redis_url:
            _check_redis(redis_url)
        else:
            from services.common.redis_server import start_redis

            redis = start_redis(
                settings.redis_port, log_path=log_dir / "redis.log", preexec_fn=child_setup()
            )
            redis_url = redis.url
        print(f"  ✓ redis at {redis_url}", flush=True)
        _start(settings, supervisor, redis_url, stop_signal)
        gateway = supervisor.children[-1]
        model_name = _served_model_name(gateway.addresses.get("gateway-http"))
        _print_summary(settings, gateway, redis_url, log_dir, model_name)
        return _serve(supervisor, stop_signal)
    except Interrupted:
        print("pdserve up: interrupted while starting; stopping", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        _print_failed(supervisor)
        return 1
    finally:
        _stop_all(supervisor, redis)


def _start(settings: UpSettings, sup: Supervisor, redis_url: str, stop_signal: list) -> None:
    """Start the kvstore and the workers together, then the gateway; return when all serve."""
    python = [sys.executable, "-m", "services.cli"]
    registry = ["--redis-url", redis_url, "--redis-prefix", settings.redis_prefix]
    engine = ["--model", settings.model, *settings.engine_flags]
    started = []
    if settings.num_prefill > 0:
        argv = [*python, "kvstore", "--port", "0", "--capacity-bytes", settings.kvstore_capacity]
        started.append(sup.start("kvstore", [*argv, *registry], ["kvstore"]))
    roles = ["prefill"] * settings.num_prefill + ["decode"] * settings.num_decode
    slices = cpu_slices(sorted(os.sched_getaffinity(0)), len(roles))
    counts = {"prefill": 0, "decode": 0}
    for role, cpus in zip(roles, slices, strict=True):
        threads = settings.num_threads or len(cpus)
        argv = [*python, role, "--port", "0", *registry, *engine, "--num-threads", str(threads)]
        name = f"{role}-{counts[role]}"
        counts[role] += 1
        started.append(sup.start(name, argv, [role], cpus=cpus))
    _wait_ready(started, settings.startup_timeout_s, stop_signal)

    argv = [*python, "gateway", "--port", str(settings.port)]
    argv += ["--http-port", str(settings.http_port), *registry, "--model", settings.model]
    argv += ["--disaggregation", "on" if settings.disaggregation else "off"]
    argv += ["--local-prefill-threshold", str(settings.local_prefill_threshold)]
    if settings.max_model_len is not None:
        argv += ["--max-model-len", str(settings.max_model_len)]
    expect = ["gateway"] + (["gateway-http"] if settings.http_port >= 0 else [])
    _wait_ready([sup.start("gateway", argv, expect)], settings.startup_timeout_s, stop_signal)


def _wait_ready(children: list[Child], timeout: float, stop_signal: list) -> None:
    """Wait for READY lines, printing each service as it comes up and who is still loading."""
    shown: set[str] = set()
    last_progress = time.monotonic()

    def on_tick() -> None:
        nonlocal last_progress
        if stop_signal:
            raise Interrupted
        for child in children:
            if child.ready and child.name not in shown:
                shown.add(child.name)
                last_progress = time.monotonic()
                address = child.addresses[child.expect[0]]
                print(f"  ✓ {child.name} ready at {address} ({child.ready_after_s:.1f} s)")
        sys.stdout.flush()
        if time.monotonic() - last_progress >= _PROGRESS_EVERY_S:
            last_progress = time.monotonic()
            waiting = [c for c in children if not c.ready]
            elapsed = time.monotonic() - min(c.started_at for c in children)
            names = ", ".join(c.name for c in waiting)
            print(f"    waiting for {names} ({elapsed:.0f} s)...", flush=True)

    poll_ready(children, timeout, on_tick)
    on_tick()


def _serve(sup: Supervisor, stop_signal: list) -> int:
    """Wait for a signal (exit 0) or for a child to die (exit 1)."""
    while not stop_signal:
        dead = sup.dead()
        if dead is not None:
            print(f"pdserve up: {dead.name} {dead.exit_text()}; stopping", file=sys.stderr)
            _print_tail(dead)
            return 1
        sup.drain(0.5)
    print(f"\npdserve up: {signal.Signals(stop_signal[0]).name}: stopping", flush=True)
    return 0


def _stop_all(sup: Supervisor, redis) -> None:
    """Gateway first (no new requests), then the workers, the kvstore, and Redis last; the
    stages share ``_STOP_TIMEOUT_S``, each gets at least 2 s before SIGKILL."""
    workers = [c for c in sup.children if c.name not in ("gateway", "kvstore")]
    stages = [
        ("gateway", [c for c in sup.children if c.name == "gateway"]),
        ("workers", workers),
        ("kvstore", [c for c in sup.children if c.name == "kvstore"]),
    ]
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for name, children in stages:
        if not any(c.alive() for c in children):
            continue
        began = time.monotonic()
        sup.stop(children, max(deadline, began + 2.0))
        print(f"  stopped {name} ({time.monotonic() - began:.1f} s)", flush=True)
    if redis is not None:
        redis.stop()
        print("  stopped redis", flush=True)
    print("pdserve up: stopped", flush=True)


def _check_redis(url: str) -> None:
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
    except (redis.RedisError, OSError) as e:
        raise RuntimeError(f"Redis at {url} does not answer ({e}); check --redis-url") from None


def _served_model_name(http_address: str | None) -> str | None:
    """The model name the gateway serves, from GET /v1/models (None without REST)."""
    if http_address is None:
        return None
    import httpx

    try:
        response = httpx.get(f"http://{http_address}/v1/models", timeout=10.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"pdserve up: could not read the model name from the gateway: {e}", file=sys.stderr)
        return None


def _print_summary(
    settings: UpSettings, gateway: Child, redis_url: str, log_dir: Path, model: str | None
) -> None:
    http = gateway.addresses.get("gateway-http")
    lines = ["", "pdserve is up:"]
    if http:
        lines.append(f"  REST   http://{http}/v1")
    lines += [f"  gRPC   {gateway.addresses['gateway']}", f"  Redis  {redis_url}"]
    lines += [f"  logs   {log_dir}", f"  model  {model or settings.model}", ""]
    if http and model:
        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 32,
            }
        )
        lines += [
            "Try it:",
            f"  curl -s http://{http}/v1/chat/completions -H 'Content-Type: application/json'"
            f" -d {shlex.quote(body)}",
        ]
    status = f"pdserve status --redis-url {redis_url}"
    if settings.redis_prefix != "pdserve":
        status += f" --redis-prefix {settings.redis_prefix}"
    lines += [f"  {status}", "", "Ctrl-C stops everything."]
    print("\n".join(lines), flush=True)


def _print_failed(sup: Supervisor) -> None:
    """The log tails of the children that died, else of those that never became ready."""
    failed = [c for c in sup.children if not c.alive()] or [c for c in sup.children if not c.ready]
    for child in failed:
        _print_tail(child)


def _print_tail(child: Child) -> None:
    tail = child.log_tail(20)
    print(f"--- last lines of {child.log_path} ---\n{tail}\n---", file=sys.stderr, flush=True)
