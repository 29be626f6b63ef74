"""This gateway's load, for the balancer in front of several gateways: vLLM's ``GET /load``
and its ORCA load report, the ``endpoint-load-metrics`` response header (the format of
xDS's ORCA, which Envoy and the Kubernetes Gateway API inference extension read) that a
request asks for with ``endpoint-load-metrics-format: TEXT`` or ``JSON``."""

from __future__ import annotations

import json
import logging

from pdserve.gateway.admission import Admission
from pdserve.gateway.router import Router

logger = logging.getLogger(__name__)

FORMAT_HEADER = "endpoint-load-metrics-format"
REPORT_HEADER = "endpoint-load-metrics"


def server_load(admission: Admission) -> int:
    """Generation requests in this gateway: running, and queued for a slot."""
    return admission.num_running + admission.num_waiting


def named_metrics(admission: Admission, router: Router) -> list[tuple[str, float]]:
    """vLLM's two ORCA metrics, for the pools behind this gateway: ``kv_cache_usage_perc``
    (the decode pool's KV blocks in use, 0 to 1; only where workers report their blocks,
    i.e. through the registry) and ``num_requests_waiting`` (this gateway's queue and the
    decode workers' own)."""
    decode = router.pools.workers("decode")
    waiting = admission.num_waiting + sum(w.num_waiting for w in decode)
    metrics = [("num_requests_waiting", float(waiting))]
    total = sum(w.num_total_blocks for w in decode)
    if total:
        used = sum(w.active_blocks for w in decode) / total
        metrics.insert(0, ("kv_cache_usage_perc", used))
    return metrics


def report_header(fmt: str, metrics: list[tuple[str, float]]) -> dict[str, str] | None:
    """The ``endpoint-load-metrics`` header in ``fmt`` (TEXT or JSON, any case); None for
    any other format (logged: a header asks, it cannot fail the request)."""
    kind = fmt.strip().lower()
    if kind == "text":
        text = ", ".join(f"named_metrics.{name}={value}" for name, value in metrics)
        return {REPORT_HEADER: f"TEXT {text}"}
    if kind == "json":
        return {REPORT_HEADER: f"JSON {json.dumps({'named_metrics': dict(metrics)})}"}
    logger.warning("%s: %r is not TEXT or JSON; no load report sent", FORMAT_HEADER, fmt)
    return None
