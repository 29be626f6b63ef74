"""The ORCA load report's metrics and header (pdserve.gateway.load_report)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from pdserve.controlplane.registry import WorkerInfo
from pdserve.gateway.admission import Admission
from pdserve.gateway.load_report import named_metrics, report_header, server_load


def _router(*workers: WorkerInfo):
    return SimpleNamespace(pools=SimpleNamespace(workers=lambda role: list(workers)))


def test_kv_usage_is_the_decode_pools_blocks_in_use_and_waiting_adds_the_queues():
    admission = Admission(4, 8, 1.0)
    admission.num_running, admission.num_waiting = 3, 2
    a = WorkerInfo("d1", "decode", "a:1", num_total_blocks=100, num_free_blocks=75, num_waiting=1)
    b = WorkerInfo("d2", "decode", "a:2", num_total_blocks=300, num_free_blocks=125)
    metrics = named_metrics(admission, _router(a, b))
    assert metrics == [("kv_cache_usage_perc", 0.5), ("num_requests_waiting", 3.0)]
    assert server_load(admission) == 5
    header = report_header("Text", metrics)["endpoint-load-metrics"]
    assert header == (
        "TEXT named_metrics.kv_cache_usage_perc=0.5, named_metrics.num_requests_waiting=3.0"
    )
    kind, _, body = report_header("JSON", metrics)["endpoint-load-metrics"].partition(" ")
    assert kind == "JSON"
    assert json.loads(body)["named_metrics"] == dict(metrics)
    assert report_header("proto", metrics) is None


def test_without_reported_blocks_only_the_queue_is_reported():
    admission = Admission(4, 8, 1.0)
    assert named_metrics(admission, _router(WorkerInfo("d", "decode", "a:1"))) == [
        ("num_requests_waiting", 0.0)
    ]
