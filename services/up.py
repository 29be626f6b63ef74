"""`pdserve up`: Redis, a kvstore, prefill and decode workers and the gateway on this machine.

Workers load their models in parallel, each pinned to the cores ``--cpu-layout`` gives it
(``engine_cpus``; by default the decode workers split all the cores and each prefill worker
takes one of them; a worker's tensor-parallel ranks share its cores); the gateway starts
once they are registered, so its first request has somewhere to go. A child that exits is
restarted with backoff (``pdserve.local.supervisor``) while the others go on serving;
Ctrl-C stops everything in order: gateway, workers, kvstore, Redis.
Each child gets its settings as flags made from settings objects (``to_argv``), and an
environment without the ``PDSERVE_*`` variables `up` itself read, so that what `up`
decided is what every child runs with. Secrets go by environment variables, never flags
(another user can read a process's flags): the internal token is the one given, or a
random one made for this cluster; the TLS files are passed on as they are.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.controlplane.registry import Keys, redis_errors
from pdserve.core.model import default_model_dir, is_default_model, is_prepared, locate_model
from pdserve.local.cluster_state import new_state, remove_state, write_state
from pdserve.local.launcher import Child, Launcher, StartFailed, cpu_slices
from pdserve.local.pools import LocalPools
from pdserve.local.supervisor import GaveUp, RestartPolicy, Supervisor
from pdserve.planner.model import Profile
from pdserve.runtime.logs import configure_logging
from pdserve.runtime.trust_files import read_pair, read_trust_files
from pdserve.settings.commands import UpSettings, known_env
from pdserve.settings.engine import EngineArgs
from pdserve.settings.flags import env_names, parse_settings, secret_env, to_argv, warn_unknown_env
from pdserve.settings.planner import PlannerPolicy, PoolBounds
from pdserve.settings.process import (
    InternalSecuritySettings,
    RedisSettings,
    RegistrySettings,
    ServerSettings,
)
from pdserve.settings.redaction import redact_url
from pdserve.settings.services import (
    DecodeSettings,
    GatewaySettings,
    KVStoreSettings,
    PrefillSettings,
    RoutingSettings,
)

_STOP_TIMEOUT_S = 15.0
_PROGRESS_EVERY_S = 5.0
_PDSERVE = [sys.executable, "-m", "pdserve.cli"]


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while starting."""


def main(argv: Sequence[str] | None = None) -> int:
    """`pdserve up`: start the cluster, wait for Ctrl-C or SIGTERM, stop it; the exit code."""
    settings = parse_settings(
        UpSettings,
        argv,
        prog="pdserve up",
        description="Start Redis (unless --redis-url), a kvstore, --prefill prefill and "
        "--decode decode workers (loading their models in parallel, on the cores --cpu-layout "
        "gives each) and then the gateway; print its addresses and wait. "
        f"{RestartPolicy().describe()} Ctrl-C stops it all: "
        "the gateway first, then the workers, the kvstore and Redis. The engine flags go to "
        "every worker, but --prefill-tensor-parallel-size and --decode-tensor-parallel-size "
        "set each pool's own; logs go to --log-dir. The services require an internal token: "
        "the one given, else a random one made for this cluster.",
    )
    configure_logging(settings.log)
    warn_unknown_env(known_env())
    try:
        security = cluster_security(settings.security)
        if settings.ssl_certfile:
            read_pair(
                settings.ssl_certfile, settings.ssl_keyfile, ("--ssl-certfile", "--ssl-keyfile")
            )
        # Read before anything starts: a profile that does not load stops nothing later.
        profile = Profile.load(settings.planner.profile) if settings.autoscale else None
        # Resolved once here: workers racing to prepare the default model would collide.
        model = str(_model_dir(settings.engine.model))
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return 2
    return run(dataclasses.replace(settings, security=security), model, profile)


def cluster_security(given: InternalSecuritySettings) -> InternalSecuritySettings:
    """The children's security settings: ``given``'s TLS files (checked here, before anything
    starts) and its token, read from its file, or else a random token for this cluster."""
    token = read_trust_files(given).token or secrets.token_urlsafe(32)
    return dataclasses.replace(given, internal_token=token, internal_token_file=None)


def _model_dir(model: str | None) -> Path:
    """``--model``'s directory; the default model is prepared first if it is not yet."""
    if is_default_model(model) and not is_prepared(default_model_dir()):
        from pdserve.engine.prepare_model import prepare_default_model

        return prepare_default_model(progress=True)
    return locate_model(model)


def run(settings: UpSettings, model: str, profile: Profile | None = None) -> int:
    """Start the cluster serving ``model`` (with --autoscale, sized by the planner on
    ``profile``), wait for a signal, stop it; the exit code."""
    stop_signal: list[int] = []

    def on_signal(signum, _frame) -> None:
        stop_signal.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    log_dir = Path(settings.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    own = env_names([UpSettings])
    env = {k: v for k, v in os.environ.items() if k not in own}
    launcher = Launcher(log_dir, env=env, die_with_launcher=True)
    redis = planner = None
    try:
        print(f"pdserve up: logs in {log_dir}", flush=True)
        redis_url = settings.redis.redis_url
        if redis_url:
            _check_redis(redis_url)
        else:
            from pdserve.local.redis_server import start_redis

            redis = start_redis(settings.redis_port, launcher=launcher)
            redis_url = redis.url
        print(f"  ✓ redis at {redact_url(redis_url)}", flush=True)
        redis_settings = RedisSettings(redis_url, settings.redis.redis_prefix)
        pools = policy = None
        if profile is not None:
            pools, policy = _pools(settings, profile, model, launcher, redis_settings)
        gateway = _start(settings, model, launcher, redis_settings, stop_signal, pools)
        model_name = _served_model_name(gateway.addresses.get("gateway-http"))
        http = gateway.addresses.get("gateway-http")
        write_state(
            new_state(
                redis_url,
                redis_settings.redis_prefix,
                gateway.address,
                f"http://{http}/v1" if http else "",
                log_dir,
            )
        )
        _print_summary(gateway, redis_settings, log_dir, model, model_name, settings)
        supervisor = Supervisor(
            launcher,
            launcher.children,
            settings.startup_timeout,
            on_exit=lambda child, pid: _forget_pid(redis_settings, child.name, pid),
        )
        if pools is not None:
            pools.supervisor = supervisor
            planner = _start_planner(
                settings, policy, profile, redis_settings, gateway, pools, model_name
            )
        return _serve(supervisor, stop_signal, pools)
    except Interrupted:
        print("pdserve up: interrupted while starting; stopping", file=sys.stderr)
        return 130
    except (StartFailed, RuntimeError, OSError) as e:
        print(f"pdserve up: error: {e}", file=sys.stderr)
        return 1
    finally:
        if planner is not None:
            planner.stop()
        remove_state(os.getpid())
        _stop_all(launcher, redis)


def _start(
    settings: UpSettings,
    model: str,
    launcher: Launcher,
    redis: RedisSettings,
    stop_signal: list,
    pools: LocalPools | None = None,
) -> Child:
    """Start the kvstore and the workers together (``pools``' first workers, with
    --autoscale), then the gateway; return the gateway."""
    registry = RegistrySettings(redis=redis)
    started = []
    if settings.prefill_workers > 0:
        kvstore = KVStoreSettings(
            server=ServerSettings(port=0, drain_timeout=5.0),
            capacity_bytes=settings.kvstore_capacity,
            registry=registry,
            tracing=settings.tracing,
            security=settings.security,
            log=settings.log,
        )
        started.append(_launch(launcher, "kvstore", "kvstore", kvstore))
    roles = ["prefill"] * settings.prefill_workers + ["decode"] * settings.num_decode
    if pools is not None:
        started += [pools.add(role) for role in roles]
    else:
        slices = engine_cpus(settings.cpu_layout, sorted(os.sched_getaffinity(0)), roles)
        shared = len({c for cpus in slices for c in cpus}) < sum(len(cpus) for cpus in slices)
        # A worker's tensor-parallel ranks run on its slice: more ranks than cores share them.
        shared = shared or any(
            settings.tensor_parallel_size(role) > len(cpus)
            for role, cpus in zip(roles, slices, strict=True)
        )
        start_worker = _worker_starter(settings, model, launcher, registry, shared)
        counts = {"prefill": 0, "decode": 0}
        for role, cpus in zip(roles, slices, strict=True):
            started.append(start_worker(role, f"{role}-{counts[role]}", cpus))
            counts[role] += 1
    _wait_ready(launcher, started, settings.startup_timeout, stop_signal)

    gateway = GatewaySettings(
        server=ServerSettings(port=settings.port, drain_timeout=10.0),
        http_port=settings.http_port,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        disaggregation=settings.disaggregation,
        model=model,
        max_model_len=settings.engine.max_model_len,
        routing=RoutingSettings(local_prefill_threshold=settings.local_prefill_threshold),
        openai=settings.openai,
        redis=redis,
        tracing=settings.tracing,
        security=settings.security,
        log=settings.log,
    )
    expect = ["gateway"] + (["gateway-http"] if settings.http_port >= 0 else [])
    child = _launch(launcher, "gateway", "gateway", gateway, expect=expect)
    _wait_ready(launcher, [child], settings.startup_timeout, stop_signal)
    # A restarted gateway binds the ports this one got (the ones printed), not new free ones.
    pinned = dataclasses.replace(
        gateway,
        server=dataclasses.replace(gateway.server, port=_port(child.address)),
        http_port=_port(child.addresses["gateway-http"]) if "gateway-http" in expect else -1,
    )
    child.argv = [*_PDSERVE, "gateway", *to_argv(pinned, secrets=False)]
    return child


def _worker_starter(
    settings: UpSettings,
    model: str,
    launcher: Launcher,
    registry: RegistrySettings,
    shared: bool,
):
    """``start(role, name, cpus)``: launch one worker on ``cpus`` (not waiting for it);
    ``shared``: whether workers share cores."""
    # OpenMP threads that wait for work spin for a while before they sleep; on a core
    # another engine uses, that spinning steals its time.
    env = {"GOMP_SPINCOUNT": "10000"} if shared else None

    def start(role: str, name: str, cpus: Sequence[int]) -> Child:
        engine = worker_engine(settings, role, cpus, model)
        cls = PrefillSettings if role == "prefill" else DecodeSettings
        worker = cls(
            server=ServerSettings(port=0),
            transport=settings.transport,
            registry=registry,
            engine=engine,
            watchdog=settings.watchdog,
            tracing=settings.tracing,
            security=settings.security,
            log=settings.log,
        )
        return _launch(launcher, name, role, worker, cpus=cpus, env=env)

    return start


def _pools(
    settings: UpSettings, profile: Profile, model: str, launcher: Launcher, redis: RedisSettings
) -> tuple[LocalPools, PlannerPolicy]:
    """The pools --autoscale resizes, each worker on the profile's cores per worker, and the
    planner's policy with their bounds on this machine."""
    cpus = sorted(os.sched_getaffinity(0))
    per_worker = settings.engine.num_threads or int(profile.hardware.get("cores_per_worker", 1))
    registry = RegistrySettings(redis=redis)
    # Shared cores when the largest pools would outnumber them.
    bounds = _local_bounds(settings, len(cpus), per_worker)
    most = min(bounds.max_prefill + bounds.max_decode, bounds.max_workers)
    shared = most * per_worker > len(cpus)
    start_worker = _worker_starter(settings, model, launcher, registry, shared)
    pools = LocalPools(launcher, start_worker, cpus, per_worker, _STOP_TIMEOUT_S + 45.0)
    return pools, dataclasses.replace(settings.planner, bounds=bounds)


def _local_bounds(settings: UpSettings, cores: int, per_worker: int) -> PoolBounds:
    """--max-workers, unless given, is what this machine's cores hold."""
    bounds = settings.planner.bounds
    if bounds.max_workers:
        return bounds
    return dataclasses.replace(bounds, max_workers=max(cores // max(per_worker, 1), 1))


class _PlannerThread:
    """The planner of --autoscale, in a thread of its own with its own event loop."""

    def __init__(self, target) -> None:
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=target, args=(self.stopped,), name="planner")
        self.thread.daemon = True
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)


def _start_planner(
    settings: UpSettings,
    policy: PlannerPolicy,
    profile: Profile,
    redis: RedisSettings,
    gateway: Child,
    pools: LocalPools,
    model_name: str | None,
) -> _PlannerThread:
    """Run the planner over ``pools``, reading the gateway's metrics on its REST port."""
    import asyncio

    from pdserve.controlplane.signing import Verifier
    from pdserve.controlplane.view import RegistryView
    from pdserve.planner import online

    planner = online.Planner(
        profile, policy, settings.disaggregation, settings.local_prefill_threshold
    )
    scraper = online.Scraper([f"http://{gateway.addresses['gateway-http']}/metrics"])
    metrics = online.PlannerMetrics(model_name or profile.model)
    token = settings.security.internal_token

    def run(stopped: threading.Event) -> None:
        async def main() -> None:
            view = RegistryView(
                redis.redis_url, prefix=redis.redis_prefix, verifier=Verifier.for_tokens(token)
            )
            await view.start()
            try:
                await online.run(planner, scraper, pools, metrics, view, stopped)
            finally:
                await view.close()

        try:
            asyncio.run(main())
        except Exception:  # noqa: BLE001 - the cluster goes on at its last sizes
            logging.getLogger("pdserve.planner").exception("the planner stopped")

    b = policy.bounds
    print(
        f"  ✓ planner: every {policy.interval:g} s, targets p90 TTFT "
        f"{policy.targets.ttft_p90_ms:g} ms and ITL {policy.targets.itl_p90_ms:g} ms; "
        f"prefill {b.min_prefill}-{b.max_prefill}, decode {b.min_decode}-{b.max_decode}, "
        f"at most {b.max_workers} workers of {pools.cores_per_worker} core(s)",
        flush=True,
    )
    return _PlannerThread(run)


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _launch(
    launcher: Launcher,
    name: str,
    command: str,
    settings: object,
    expect: Sequence[str] | None = None,
    cpus: Sequence[int] | None = None,
    env: dict[str, str] | None = None,
) -> Child:
    argv = [*_PDSERVE, command, *to_argv(settings, secrets=False)]
    env = {**(env or {}), **secret_env(settings)}
    return launcher.start(name, argv, expect or [command], cpus=cpus, env=env)


def worker_engine(settings: UpSettings, role: str, cpus: Sequence[int], model: str) -> EngineArgs:
    """The engine of a ``role`` worker pinned to ``cpus``: its pool's tensor-parallel size,
    and its threads, unless --num-threads says, the worker's cores split among its ranks
    (the followers inherit the worker's cores)."""
    size = settings.tensor_parallel_size(role)
    threads = settings.engine.num_threads or max(1, len(cpus) // size)
    return dataclasses.replace(
        settings.engine, model=model, num_threads=threads, tensor_parallel_size=size
    )


def engine_cpus(layout: str, cpus: Sequence[int], roles: Sequence[str]) -> list[list[int]]:
    """The cores of each worker (``roles``: "prefill" or "decode", in order) by layout.

    decode-first (the default, measured fastest on 2 cores: bench/RESULTS.md) gives the
    decode workers the whole machine, split among them, and each prefill worker one core,
    from the last one down: decode is the steady load, prefill comes in bursts.
    """
    if layout == "shared":
        return [list(cpus) for _ in roles]
    if layout == "split":
        return cpu_slices(cpus, len(roles))
    decode = iter(cpu_slices(cpus, roles.count("decode")))
    out, k = [], 0
    for role in roles:
        if role == "decode":
            out.append(next(decode))
        else:
            out.append([cpus[-1 - k % len(cpus)]])
            k += 1
    return out


def _wait_ready(launcher: Launcher, children: list[Child], timeout: float, stop_signal: list):
    """Wait for READY lines, printing each service as it comes up and who is still loading."""
    shown: set[str] = set()
    last_progress = time.monotonic()

    def on_tick() -> None:
        nonlocal last_progress
        if stop_signal:
            raise Interrupted
        for child in children:
            if child.ready_after_s is not None and child.name not in shown:
                shown.add(child.name)
                last_progress = time.monotonic()
                print(f"  ✓ {child.name} ready at {child.address} ({child.ready_after_s:.1f} s)")
        sys.stdout.flush()
        if time.monotonic() - last_progress >= _PROGRESS_EVERY_S:
            last_progress = time.monotonic()
            names = ", ".join(c.name for c in children if not c.ready)
            elapsed = time.monotonic() - min(c.started_at for c in children)
            print(f"    waiting for {names} ({elapsed:.0f} s)...", flush=True)

    launcher.wait_ready(children, timeout, on_tick)
    on_tick()


def _serve(supervisor: Supervisor, stop_signal: list, pools: LocalPools | None = None) -> int:
    """Keep the children running (and, with --autoscale, the pools at the planner's sizes)
    until a signal (exit 0), or until one crashes too often in a row (exit 1)."""
    while not stop_signal:
        try:
            if pools is not None:
                pools.reconcile()
            supervisor.tick()
        except GaveUp as e:
            print(f"pdserve up: {e}", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.5)
    print(f"\npdserve up: {signal.Signals(stop_signal[0]).name}: stopping", flush=True)
    return 0


def _forget_pid(redis: RedisSettings, name: str, pid: int) -> None:
    """Remove the registry entries of process ``pid`` (a child that died without
    deregistering), so that gateways stop routing to it now rather than at its TTL."""
    if name in ("redis", "gateway"):
        return
    import redis as redis_client

    keys = Keys(redis.redis_prefix)
    try:
        client = redis_client.Redis.from_url(
            redis.redis_url, socket_connect_timeout=2, socket_timeout=2
        )
        with client:
            for key in client.scan_iter(match=keys.worker("*"), count=100):
                entry = client.get(key)
                info = json.loads(entry) if entry is not None else {}
                if info.get("pid") != pid:
                    continue
                worker_id = info["worker_id"]
                client.delete(key, keys.blocks(worker_id))
                client.publish(keys.events, json.dumps({"kind": "down", "id": worker_id}))
    except (*redis_errors(), OSError, ValueError) as e:
        print(f"pdserve up: could not remove {name}'s registry entry ({e})", file=sys.stderr)


def _stop_all(launcher: Launcher, redis) -> None:
    """Gateway first (no new requests), then the workers, the kvstore, and Redis last; the
    stages share ``_STOP_TIMEOUT_S``, each gets at least 2 s before SIGKILL."""
    by_name = {c.name: c for c in launcher.children}
    stages = [
        ("gateway", [by_name["gateway"]] if "gateway" in by_name else []),
        ("workers", [c for c in launcher.children if c.name.startswith(("prefill", "decode"))]),
        ("kvstore", [by_name["kvstore"]] if "kvstore" in by_name else []),
    ]
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for name, children in stages:
        if not any(c.alive() for c in children):
            continue
        began = time.monotonic()
        launcher.stop(children, max(deadline, began + 2.0) - began)
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
        raise RuntimeError(
            f"Redis at {redact_url(url)} does not answer ({e}); check --redis-url"
        ) from None


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
    gateway: Child,
    redis: RedisSettings,
    log_dir: Path,
    model_dir: str,
    model: str | None,
    settings: UpSettings,
) -> None:
    """Where to send requests, a curl to paste, and how to see the cluster's state."""
    http = gateway.addresses.get("gateway-http")
    lines = ["", "pdserve is up:"]
    scheme = "https" if settings.ssl_certfile else "http"
    if http:
        lines.append(f"  REST   {scheme}://{http}/v1")
    tls = " (TLS)" if settings.ssl_certfile else ""
    shown_url = redact_url(redis.redis_url)
    lines += [f"  gRPC   {gateway.address}{tls}", f"  Redis  {shown_url}"]
    lines += [f"  logs   {log_dir}", f"  model  {model or model_dir}", ""]
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
            f"  curl -s {scheme}://{http}/v1/chat/completions -H 'Content-Type: application/json'"
            f" -d {shlex.quote(body)}",
        ]
    lines += ["  pdserve status        (this cluster's pools, from any shell here)"]
    lines += ["", "Ctrl-C stops everything."]
    print("\n".join(lines), flush=True)
