"""Prometheus metrics of every pdserve service, with vLLM's names under ``pdserve:``.

Each process has one ``CollectorRegistry`` (``new_registry``: with the process's own CPU,
memory and GC series). Every pdserve series carries ``model_name`` (where the service knows
the model) and ``role``: gateway, prefill, decode or kvstore, the pool it came from.
Request-level figures are histograms with vLLM's buckets (``RequestMetrics``), observed as
requests end; server-level ones (running, waiting, KV use, counters kept by the engine or
the store) are read from their owner when scraped, so they cost nothing per request.
Workers and kvstores serve the registry on ``--metrics-port`` (``serve_metrics``); the
gateway on its REST port.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from pdserve.core.finish_reason import FinishReason
from pdserve.settings.process import host_port

logger = logging.getLogger(__name__)

PREFIX = "pdserve:"
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards made for vLLM read ours.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# KV transfers take milliseconds, not seconds.
TRANSFER_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

prometheus_client.disable_created_metrics()  # no `_created` series beside every counter


def name(short: str) -> str:
    """``short`` under the ``pdserve:`` prefix."""
    return PREFIX + short


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50 ... up to ``max_value``: vLLM's buckets for token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def new_registry() -> CollectorRegistry:
    """A registry with this process's CPU, memory, file and GC series."""
    registry = CollectorRegistry()
    prometheus_client.ProcessCollector(registry=registry)
    prometheus_client.PlatformCollector(registry=registry)
    prometheus_client.GCCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus's text format."""
    return prometheus_client.generate_latest(registry)


CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
        pass


class MetricsServer:
    """``registry`` served over HTTP (GET /metrics) from a thread of its own, and
    ``GET /health``: 200 while the service serves, 503 once it drains or fails (``health``,
    set by the service), as plain HTTP a kubelet can probe when the gRPC port speaks TLS."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.health: Callable[[], bool] = lambda: True
        metrics_app = prometheus_client.make_wsgi_app(registry)

        def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == "/health":
                ok = self.health()
                status = "200 OK" if ok else "503 Service Unavailable"
                start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
                return [b"SERVING\n" if ok else b"NOT_SERVING\n"]
            return metrics_app(environ, start_response)

        try:
            family = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            server_class = type("_Server", (ThreadingWSGIServer,), {"address_family": family[0][0]})
            self._server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        except OSError as error:
            raise OSError(
                f"--metrics-port {port}: cannot listen on {host}:{port}: {error}"
            ) from None
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics(
    settings: Any, registry: CollectorRegistry, resources: contextlib.AsyncExitStack
) -> MetricsServer | None:
    """``registry`` served on ``settings.metrics.metrics_port`` at ``settings.server.host``
    (closed with ``resources``); None when the port is -1. OSError when it cannot bind."""
    port = settings.metrics.metrics_port
    if port < 0:
        return None
    server = MetricsServer(registry, settings.server.host, port)
    resources.callback(server.close)
    return server


def metrics_server_address(settings: Any, server: MetricsServer | None) -> str:
    """The HOST:PORT others scrape (the advertised host, when one is set); "" without."""
    if server is None:
        return ""
    advertised = settings.registry.advertise_address
    host = advertised.rpartition(":")[0] if advertised else settings.server.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return host_port(host.strip("[]"), server.port)


@dataclass(frozen=True)
class Labels:
    """The labels every series of one service carries."""

    role: str
    model_name: str | None = None  # a kvstore serves any model: no model_name

    @property
    def names(self) -> tuple[str, ...]:
        return ("model_name", "role") if self.model_name is not None else ("role",)

    @property
    def values(self) -> tuple[str, ...]:
        return (self.model_name, self.role) if self.model_name is not None else (self.role,)


class RequestMetrics:
    """vLLM's request-level series: latencies, token counts, finish reasons.

    ``observe_*`` are called as requests go; each takes one lock per series.
    """

    def __init__(self, registry: CollectorRegistry, labels: Labels, max_model_len: int) -> None:
        names, values = labels.names, labels.values

        def histogram(short: str, text: str, buckets: Sequence[float]) -> Histogram:
            h = Histogram(name(short), text, names, buckets=buckets, registry=registry)
            return h.labels(*values)

        def counter(short: str, text: str) -> Counter:
            return Counter(name(short), text, names, registry=registry).labels(*values)

        tokens = token_buckets(max_model_len)
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from a request's arrival to its first token, in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between two consecutive tokens of a request, in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "A request's mean time per output token after the first, in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Time from a request's arrival to its last token, in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "request_queue_time_seconds",
            "Time a request waited before it was scheduled (at the gateway: for an "
            "admission slot), in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated (at the gateway: completion tokens)."
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated per request.", tokens
        )
        self._success = Counter(
            name("request_success"),
            "Finished requests, by finish reason.",
            [*names, "finished_reason"],
            registry=registry,
        )
        self._values = values

    def finished(self, reason: FinishReason) -> None:
        """Count one finished request."""
        self._success.labels(*self._values, reason).inc()

    def tokens(self, prompt: int, generated: int) -> None:
        """Count a finished request's prompt and generated tokens."""
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.request_prompt_tokens.observe(prompt)
        self.request_generation_tokens.observe(generated)


class SnapshotCollector(Collector):
    """Series read from their owner at each scrape: ``read()`` returns (name, kind, help,
    value) rows, kind "gauge" or "counter", each row's series labelled ``labels``; extra
    labelled rows come as (name, kind, help, {label: value}, value)."""

    def __init__(self, labels: Labels, read: Callable[[], Iterable[tuple]]) -> None:
        self._labels = labels
        self._read = read

    def collect(self) -> Iterable:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for row in self._read():
            short, kind, text = row[:3]
            extra, value = (row[3], row[4]) if len(row) == 5 else ({}, row[3])
            family = families.get(short)
            if family is None:
                cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                family = cls(name(short), text, labels=[*self._labels.names, *extra])
                families[short] = family
            family.add_metric([*self._labels.values, *extra.values()], value)
        return list(families.values())


def spec_rows(spec: Any) -> Iterable[tuple]:
    """``SnapshotCollector`` rows of speculative decoding's counters (vLLM's
    ``spec_decode_*``), from a ``SpecDecodeStats``."""
    yield (
        "spec_decode_num_drafts",
        "counter",
        "Verifications of a request with proposed tokens (speculative decoding).",
        spec.num_drafts,
    )
    yield ("spec_decode_num_draft_tokens", "counter", "Tokens proposed.", spec.num_draft_tokens)
    yield (
        "spec_decode_num_accepted_tokens",
        "counter",
        "Proposed tokens accepted by verification.",
        spec.num_accepted_tokens,
    )
    text = "Proposed tokens accepted, by their position among a request's proposals (0 first)."
    for position, n in enumerate(spec.accepted_per_pos):
        yield (
            "spec_decode_num_accepted_tokens_per_pos",
            "counter",
            text,
            {"position": str(position)},
            n,
        )
