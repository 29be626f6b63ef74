"""The metrics port's GET /health (pdserve.runtime.metrics.MetricsServer): what a kubelet
probes when the gRPC port speaks TLS, and what a drain turns to 503."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, Counter

from pdserve.runtime import service
from pdserve.runtime.metrics import MetricsServer
from pdserve.runtime.service import Serving


class _Stub:
    async def stop(self, grace):
        return None

    class health_servicer:  # noqa: N801 - the attribute name gRPC's server carries
        @staticmethod
        async def enter_graceful_shutdown():
            return None


def test_health_follows_the_service_and_metrics_stay_served(monkeypatch):
    registry = CollectorRegistry()
    Counter("pdserve_probe_total", "a series", registry=registry).inc()
    server = MetricsServer(registry, "127.0.0.1", 0)
    serving = Serving(_Stub(), 1)
    server.health = lambda: not serving.draining
    base = f"http://127.0.0.1:{server.port}"
    try:
        ok = httpx.get(f"{base}/health", timeout=5)
        assert (ok.status_code, ok.text) == (200, "SERVING\n")
        monkeypatch.setattr(service, "DEREGISTER_PAUSE_S", 0)
        asyncio.run(service._drain(serving, 0.1))  # what SIGTERM runs
        down = httpx.get(f"{base}/health", timeout=5)
        assert (down.status_code, down.text) == (503, "NOT_SERVING\n")
        metrics = httpx.get(f"{base}/metrics", timeout=5)
        assert metrics.status_code == 200 and "pdserve_probe_total 1.0" in metrics.text
    finally:
        server.close()
