"""`pdserve planner`: every --interval, read the cluster's traffic from its gateways'
metrics, predict with the profile which replicas per pool meet the targets, and set them.

A decision reads the gateways' counters over the last --window seconds: the arrival rate
(finished requests plus the growth of those in flight), the mean prompt and output lengths,
and, for the log and the dashboard, the p90 TTFT and ITL the clients saw. The registry says
how many workers each pool has registered. ``pdserve.planner.plan`` then gives the pools
that meet the targets at the observed rate (scale out at once, to that size) and at the
rate plus --headroom (scale in, one worker at a time, only once that smaller pool has
sufficed for --scale-down-delay seconds). Scaling in is always a drain: the actuator stops
a worker (SIGTERM, or a smaller Deployment), which deregisters, finishes or hands over its
streams, and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import socket
import sys
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from pdserve.planner.actuators import POOLS, Actuator, ActuatorError
from pdserve.planner.model import Profile
from pdserve.planner.plan import plan
from pdserve.planner.simulate import Cluster, Traffic, simulate
from pdserve.runtime.metrics import name, new_registry
from pdserve.settings.planner import PlannerPolicy, PlannerSettings, PoolBounds

logger = logging.getLogger("pdserve.planner")

SCRAPE_TIMEOUT_S = 5.0
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]+)"')


# --- what the gateways say -----------------------------------------------------------


@dataclass
class Sample:
    """The gateways' counters at one moment, summed over gateways."""

    at: float
    finished: float = 0.0
    in_flight: float = 0.0
    prompt_sum: float = 0.0
    prompt_count: float = 0.0
    output_sum: float = 0.0
    output_count: float = 0.0
    ttft: dict[float, float] = field(default_factory=dict)  # le -> cumulative count
    itl: dict[float, float] = field(default_factory=dict)
    gateways: int = 0


def parse_sample(texts: Sequence[str], at: float) -> Sample:
    """Sum the series the planner reads over the gateways' exposition ``texts``."""
    s = Sample(at=at, gateways=len(texts))
    plain = {
        "pdserve:request_success_total": "finished",
        "pdserve:num_requests_running": "in_flight",
        "pdserve:num_requests_waiting": "in_flight",
        "pdserve:request_prompt_tokens_sum": "prompt_sum",
        "pdserve:request_prompt_tokens_count": "prompt_count",
        "pdserve:request_generation_tokens_sum": "output_sum",
        "pdserve:request_generation_tokens_count": "output_count",
    }
    buckets = {
        "pdserve:time_to_first_token_seconds_bucket": s.ttft,
        "pdserve:inter_token_latency_seconds_bucket": s.itl,
    }
    for text in texts:
        for line in text.splitlines():
            m = _LINE.match(line)
            if m is None:
                continue
            metric, labels, value = m.group(1), m.group(2) or "", m.group(3)
            if metric in plain and 'role="gateway"' in labels:
                setattr(s, plain[metric], getattr(s, plain[metric]) + float(value))
            elif metric in buckets and (le := _LE.search(labels)):
                edge = float(le.group(1))
                buckets[metric][edge] = buckets[metric].get(edge, 0.0) + float(value)
    return s


def bucket_percentile(cumulative: dict[float, float], p: float) -> float | None:
    """The ``p`` percentile (seconds) of a histogram's cumulative bucket counts, linear
    within a bucket as Prometheus' histogram_quantile; None without observations."""
    edges = sorted(cumulative)
    if not edges or cumulative[edges[-1]] <= 0:
        return None
    rank = cumulative[edges[-1]] * p / 100.0
    lower_edge, lower_count = 0.0, 0.0
    for edge in edges:
        count = cumulative[edge]
        if count >= rank:
            if math.isinf(edge):
                return lower_edge
            inside = count - lower_count
            frac = (rank - lower_count) / inside if inside > 0 else 1.0
            return lower_edge + (edge - lower_edge) * frac
        lower_edge, lower_count = edge, count
    return lower_edge


@dataclass(frozen=True)
class Observed:
    """The traffic over a window."""

    seconds: float
    request_rate: float
    prompt_len: float | None  # None: no request finished in the window
    output_len: float | None
    in_flight: float
    ttft_p90_ms: float | None
    itl_p90_ms: float | None

    def describe(self) -> str:
        lens = (
            f", prompts {self.prompt_len:.0f}, outputs {self.output_len:.0f} tokens"
            if self.prompt_len is not None
            else ""
        )
        seen = ""
        if self.ttft_p90_ms is not None:
            seen = f"; seen p90 TTFT {self.ttft_p90_ms:.0f} ms"
            if self.itl_p90_ms is not None:
                seen += f", ITL {self.itl_p90_ms:.1f} ms"
        return f"{self.request_rate:.2f} req/s{lens}, {self.in_flight:.0f} in flight{seen}"


class Window:
    """Samples of the last ``seconds``; ``observe`` compares the newest with the oldest."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._samples: deque[Sample] = deque()
        self._prompt_len: float | None = None
        self._output_len: float | None = None

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)
        while len(self._samples) > 2 and sample.at - self._samples[1].at >= self.seconds:
            self._samples.popleft()

    def observe(self) -> Observed | None:
        if len(self._samples) < 2:
            return None
        a, b = self._samples[0], self._samples[-1]
        dt = b.at - a.at
        if dt <= 0:
            return None
        finished = max(b.finished - a.finished, 0.0)  # a gateway restarted: its count fell
        rate = max(finished + b.in_flight - a.in_flight, 0.0) / dt
        if b.prompt_count > a.prompt_count:
            self._prompt_len = (b.prompt_sum - a.prompt_sum) / (b.prompt_count - a.prompt_count)
            self._output_len = (b.output_sum - a.output_sum) / (b.output_count - a.output_count)

        def p90(name: str) -> float | None:
            new, old = getattr(b, name), getattr(a, name)
            value = bucket_percentile({e: c - old.get(e, 0.0) for e, c in new.items()}, 90)
            return None if value is None else value * 1000.0

        return Observed(
            dt, rate, self._prompt_len, self._output_len, b.in_flight, p90("ttft"), p90("itl")
        )


class Scraper:
    """GETs each gateway's metrics: every address a URL's host name has (a headless Service
    names every gateway pod)."""

    def __init__(self, urls: Sequence[str], timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.urls = list(urls)
        self.timeout_s = timeout_s

    def targets(self) -> list[str]:
        out = []
        for url in self.urls:
            parts = urllib.parse.urlsplit(url)
            host, port = (
                parts.hostname or "",
                parts.port or (443 if parts.scheme == "https" else 80),
            )
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                out.append(url)  # the GET says why
                continue
            for addr in sorted({info[4][0] for info in infos}):
                shown = f"[{addr}]" if ":" in addr else addr
                out.append(urllib.parse.urlunsplit(parts._replace(netloc=f"{shown}:{port}")))
        return list(dict.fromkeys(out))

    def read(self) -> tuple[list[str], list[str]]:
        """The texts of the gateways that answered, and what went wrong with the others."""
        import httpx

        texts, errors = [], []
        for target in self.targets():
            try:
                response = httpx.get(target, timeout=self.timeout_s)
                response.raise_for_status()
                texts.append(response.text)
            except httpx.HTTPError as e:
                errors.append(f"{target}: {e}")
        return texts, errors


# --- deciding ------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    desired: int
    reason: str  # a label: ttft, itl, headroom, targets_met, waiting, bounds, idle
    text: str

    @property
    def direction(self) -> str:
        if self.desired > self.current:
            return "up"
        return "down" if self.desired < self.current else "hold"


class PlannerMetrics:
    """The planner's series, for Prometheus and the dashboard."""

    def __init__(self, model: str) -> None:
        self.registry = new_registry()
        labels = ("model_name", "role")
        self._values = (model, "planner")

        def gauge(short: str, text: str, extra: tuple[str, ...] = ()):
            return Gauge(name(short), text, (*labels, *extra), registry=self.registry)

        self.desired = gauge("planner_desired_replicas", "Replicas the planner wants.", ("pool",))
        self.current = gauge(
            "planner_current_replicas", "Replicas the pool is set to now.", ("pool",)
        )
        self.ttft = gauge(
            "planner_predicted_ttft_seconds", "Predicted p90 TTFT at the desired replicas."
        )
        self.itl = gauge(
            "planner_predicted_itl_seconds", "Predicted p90 ITL at the desired replicas."
        )
        self.rate = gauge("planner_observed_request_rate", "Requests per second, observed.")
        self.decisions = Counter(
            name("planner_decisions"),
            "Decisions, by pool, direction (up, down, hold) and reason.",
            (*labels, "pool", "direction", "reason"),
            registry=self.registry,
        )
        self.errors = Counter(
            name("planner_errors"),
            "Decisions not made or not applied, by kind (scrape, actuator).",
            (*labels, "kind"),
            registry=self.registry,
        )

    def error(self, kind: str) -> None:
        self.errors.labels(*self._values, kind).inc()

    def record(self, decisions: Sequence[Decision], ttft_ms: float, itl_ms: float, rate: float):
        v = self._values
        for d in decisions:
            self.desired.labels(*v, d.pool).set(d.desired)
            self.current.labels(*v, d.pool).set(d.current)
            self.decisions.labels(*v, d.pool, d.direction, d.reason).inc()
        self.ttft.labels(*v).set(ttft_ms / 1000.0)
        self.itl.labels(*v).set(itl_ms / 1000.0)
        self.rate.labels(*v).set(rate)


class Planner:
    """Decides each pool's replicas from what is observed (``decide``), with hysteresis."""

    def __init__(
        self,
        profile: Profile,
        policy: PlannerPolicy,
        disaggregation: bool,
        local_prefill_threshold: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.profile = profile
        self.policy = policy
        self.pools = POOLS if disaggregation else ("decode",)
        self.layout = "on" if disaggregation else "off"
        self.threshold = local_prefill_threshold if disaggregation else 0
        self.clock = clock
        self._smaller_since: dict[str, float] = {}
        self.last_prediction = (0.0, 0.0)

    def _bounds(self) -> PoolBounds:
        b = self.policy.bounds
        if self.layout == "on":
            return dataclasses.replace(b, min_prefill=max(b.min_prefill, 1))
        return dataclasses.replace(b, min_prefill=0, max_prefill=0)

    def _traffic(self, obs: Observed, scale: float = 1.0) -> Traffic:
        prompt = max(int(round(obs.prompt_len or self.profile.prefill.x[0])), 1)
        output = max(int(round(obs.output_len or 16)), 1)
        rate = obs.request_rate * scale
        n = int(min(max(rate * self.policy.window, 100), 400))
        return Traffic(rate, prompt, output, num_prompts=n)

    def _cluster(self, replicas: dict[str, int]) -> Cluster:
        prefill = replicas.get("prefill", 0) if self.layout == "on" else 0
        return Cluster(prefill, max(replicas["decode"], 1), self.threshold)

    def decide(self, obs: Observed, current: dict[str, int]) -> list[Decision]:
        """Each pool's decision given the traffic ``obs`` and the pools' ``current`` sizes."""
        now = self.clock()
        bounds, targets = self._bounds(), self.policy.targets
        lo = {"prefill": bounds.min_prefill, "decode": bounds.min_decode}
        hi = {"prefill": bounds.max_prefill, "decode": bounds.max_decode}
        if obs.request_rate <= 0:
            want_up = want_down = {p: lo[p] for p in self.pools}
            why_up = "no requests in the window"
            predicted = (0.0, 0.0)
            over_ttft = False
        else:
            traffic = self._traffic(obs)
            up = plan(self.profile, traffic, targets, bounds, self.layout, [self.threshold])
            down = plan(
                self.profile,
                self._traffic(obs, 1.0 + self.policy.headroom),
                targets,
                bounds,
                self.layout,
                [self.threshold],
            )
            want_up = {p: getattr(up.best.cluster, p) for p in self.pools}
            want_down = {p: getattr(down.best.cluster, p) for p in self.pools}
            best = up.best.prediction
            predicted = (best.ttft(90), best.itl(90))
            now_pred = simulate(self.profile, self._cluster(current), traffic)
            why_up = (
                f"{obs.describe()}; at {self._cluster(current).describe()} predicted p90 "
                f"TTFT {now_pred.ttft(90):.0f} ms (target {targets.ttft_p90_ms:g}), ITL "
                f"{now_pred.itl(90):.1f} ms (target {targets.itl_p90_ms:g}); at "
                f"{up.best.cluster.describe()} {predicted[0]:.0f} ms, {predicted[1]:.1f} ms"
                + ("" if up.meets else " (the closest within the bounds)")
            )
            over_ttft = now_pred.ttft(90) > targets.ttft_p90_ms
        self.last_prediction = predicted
        decisions = []
        for pool in self.pools:
            cur = current.get(pool, 0)
            up_to, down_to = want_up[pool], want_down[pool]
            if cur < lo[pool] or cur > hi[pool]:
                desired = min(max(cur, lo[pool]), hi[pool])
                reason, text = "bounds", f"outside [{lo[pool]}, {hi[pool]}]"
                self._smaller_since.pop(pool, None)
            elif up_to > cur:
                desired = up_to
                reason = "ttft" if over_ttft else "itl"
                text = why_up
                self._smaller_since.pop(pool, None)
            elif down_to < cur:
                since = self._smaller_since.setdefault(pool, now)
                left = self.policy.scale_down_delay - (now - since)
                if left <= 0:
                    desired, reason = cur - 1, "headroom" if obs.request_rate > 0 else "idle"
                    text = (
                        f"{down_to} would meet the targets at {1 + self.policy.headroom:g}x the "
                        f"rate for {now - since:.0f} s: {why_up}"
                    )
                    self._smaller_since[pool] = now
                else:
                    desired, reason = cur, "waiting"
                    text = f"{down_to} would do; scaling in after {left:.0f} s more if it holds"
            else:
                desired, reason, text = cur, "targets_met", why_up
                self._smaller_since.pop(pool, None)
            decisions.append(Decision(pool, cur, desired, reason, text))
        return decisions


# --- running -------------------------------------------------------------------------


class RegistryCounts:
    """Registered workers per pool, from the registry (the dry run's current sizes)."""

    def __init__(self, view) -> None:
        self.view = view

    def replicas(self, pool: str) -> int:
        return len(self.view.workers(pool))

    def scale(self, pool: str, replicas: int) -> None:
        logger.info("dry run: %s pool would be set to %d", pool, replicas)


async def run(
    planner: Planner,
    scraper: Scraper,
    actuator: Actuator | None,
    metrics: PlannerMetrics,
    view,
    stop: threading.Event | asyncio.Event,
    on_decisions: Callable[[list[Decision]], None] | None = None,
) -> None:
    """Decide every ``interval`` until ``stop`` is set; ``actuator`` None: a dry run (the
    registry's counts are the current sizes)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a GET each interval is no news
    window = Window(planner.policy.window)
    counts = RegistryCounts(view)
    target = actuator or counts
    interval = planner.policy.interval
    while not stop.is_set():
        texts, errors = await asyncio.to_thread(scraper.read)
        for error in errors:
            logger.warning("cannot read gateway metrics at %s", error)
        if texts:
            window.add(parse_sample(texts, time.monotonic()))
        else:
            metrics.error("scrape")
        obs = window.observe()
        if obs is not None and texts:
            try:
                current = {pool: await _replicas(target, pool) for pool in planner.pools}
            except ActuatorError as e:
                logger.error("%s", e)
                metrics.error("actuator")
                current = None
            if current is not None:
                decisions = await asyncio.to_thread(planner.decide, obs, current)
                ttft, itl = planner.last_prediction
                metrics.record(decisions, ttft, itl, obs.request_rate)
                for d in decisions:
                    line = (
                        f"{d.pool}: {d.direction} {d.current} -> {d.desired} ({d.reason}): {d.text}"
                    )
                    (logger.info if d.direction == "hold" else logger.warning)(line)
                    if d.direction != "hold":
                        try:
                            await asyncio.to_thread(target.scale, d.pool, d.desired)
                        except ActuatorError as e:
                            logger.error("%s", e)
                            metrics.error("actuator")
                if on_decisions is not None:
                    on_decisions(decisions)
        await _wait(stop, interval)


async def _replicas(target: Actuator | RegistryCounts, pool: str) -> int:
    """``pool``'s size now. The registry's view belongs to the event loop: read on it; an
    actuator may block up to its timeout (the Kubernetes API): asked off the loop."""
    if isinstance(target, RegistryCounts):
        return target.replicas(pool)
    return await asyncio.to_thread(target.replicas, pool)


async def _wait(stop, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


async def _main(settings: PlannerSettings, profile: Profile) -> int:
    from pdserve.controlplane.signing import Verifier
    from pdserve.controlplane.view import RegistryView
    from pdserve.runtime.metrics import MetricsServer
    from pdserve.runtime.token_ring import TokenRing
    from pdserve.runtime.trust_files import read_token

    token = read_token(settings.security)
    ring = TokenRing(token, settings.security.internal_token_file) if token else None
    view = RegistryView(
        settings.redis.redis_url,
        prefix=settings.redis.redis_prefix,
        verifier=Verifier.following(ring),
    )
    await view.start()
    metrics = PlannerMetrics(profile.model)
    server = None
    if settings.metrics_port >= 0:
        server = MetricsServer(metrics.registry, settings.host, settings.metrics_port)
    actuator = None
    if not settings.dry_run and settings.actuator == "kubernetes":
        from pdserve.planner.kubernetes import from_settings

        actuator = from_settings(settings)
    planner = Planner(
        profile, settings.policy, settings.disaggregation, settings.local_prefill_threshold
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    mode = "dry run" if actuator is None else "kubernetes"
    print(f"READY planner {settings.host}:{server.port if server else -1}", flush=True)
    logger.info(
        "planner (%s) with profile %s: every %g s, pools %s",
        mode,
        profile.name,
        settings.policy.interval,
        ", ".join(planner.pools),
    )
    try:
        await run(planner, Scraper(settings.gateway_metrics), actuator, metrics, view, stop)
    finally:
        await view.close()
        if server is not None:
            server.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from pdserve.core.errors import SettingsError
    from pdserve.runtime.logs import configure_logging
    from pdserve.settings.flags import parse_settings

    settings = parse_settings(
        PlannerSettings,
        argv,
        prog="pdserve planner",
        description="Size a running cluster's prefill and decode pools: every --interval, "
        "read the traffic from the gateways' metrics (--gateway-metrics) and the pools from "
        "the registry (--redis-url), predict with the profile (`pdserve profile`) the "
        "replicas that meet the p90 TTFT and ITL targets, and set them (Kubernetes: the "
        "scale of the pools' Deployments, only those). Scale-out is at once; scale-in one "
        "worker at a time after --scale-down-delay, each removed worker draining first. "
        "--dry-run logs the decisions only. Serves its metrics and /health on --metrics-port.",
    )
    configure_logging(settings.log)
    from pdserve.settings.commands import known_env
    from pdserve.settings.flags import warn_unknown_env

    warn_unknown_env(known_env())
    try:
        profile = Profile.load(settings.policy.profile)
        return asyncio.run(_main(settings, profile))
    except (ValueError, SettingsError, ActuatorError, OSError) as e:
        print(f"pdserve planner: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        with contextlib.suppress(Exception):
            logging.shutdown()
