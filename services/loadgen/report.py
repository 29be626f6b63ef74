"""The summary table printed after a run, and the JSON result file.

Result file of `pdserve bench serve` (times in per-request records are seconds,
aggregate latencies milliseconds):

    {
      "kind": "serve",
      "label": "pdserve",                # --label, else ""
      "date": "2025-01-01T12:00:00+00:00",
      "config": {                        # every flag, plus the workload's own
        "base_url": ..., "model": ..., "endpoint": "completions" | "chat",
        "workload": "random", "workload_params": {...}, "num_prompts": 8,
        "seed": 0, "request_rate": "inf" | 2.0, "max_concurrency": 4 | null,
        "ignore_eos": true, "timeout_s": 600.0, "goodput_slos_ms": {"ttft": 500},
        "tokenizer": "/path", "label": ""
      },
      "metrics": {
        "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput",
        "request_goodput" (null without --goodput),
        "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms":
            {"mean", "median", "std", "p50", "p90", "p99", "count"},
        "ttft_ms_by_kind": {"short": {...}, "long": {...}}   # long-short only
      },
      "requests": [
        {"session", "turn", "kind", "input_len", "server_input_len", "expected_output_len",
         "output_len", "start", "ttft", "itl": [...], "tpot" (null for one token), "e2el",
         "success", "status", "error"}
      ]
    }

Result file of `pdserve bench sweep`: {"kind": "sweep", "label", "date", "config"
(as above, without max_concurrency), "concurrencies": [1, 4, 16], "runs": [one
serve result per concurrency, in that order]}.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from pdserve.loadgen.metrics import BenchmarkMetrics, Distribution, RequestRecord, request_tpot

_WIDTH = 50
_MAX_ERRORS_SHOWN = 5
_LATENCIES = (
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def serve_result(
    config: dict, metrics: BenchmarkMetrics, records: list[RequestRecord], label: str
) -> dict:
    """The JSON object of one run."""
    requests = [{**asdict(r), "tpot": request_tpot(r) if r.success else None} for r in records]
    return {
        "kind": "serve",
        "label": label,
        "date": now_iso(),
        "config": config,
        "metrics": metrics.to_dict(),
        "requests": requests,
    }


def sweep_result(config: dict, concurrencies: list[int], runs: list[dict], label: str) -> dict:
    """The JSON object of a sweep: one serve result per concurrency."""
    return {
        "kind": "sweep",
        "label": label,
        "date": now_iso(),
        "config": config,
        "concurrencies": concurrencies,
        "runs": runs,
    }


def write_result(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def summary(
    metrics: BenchmarkMetrics,
    records: list[RequestRecord],
    max_concurrency: int | None,
    request_rate: float,
) -> str:
    """vLLM's "Serving Benchmark Result" table, then the failures' errors."""
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]
    rows: list[tuple[str, object]] = [
        ("Successful requests:", metrics.completed),
        ("Failed requests:", metrics.failed),
    ]
    if max_concurrency is not None:
        rows.append(("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        rows.append(("Request rate configured (RPS):", request_rate))
    rows += [
        ("Benchmark duration (s):", metrics.duration_s),
        ("Total input tokens:", metrics.total_input_tokens),
        ("Total generated tokens:", metrics.total_output_tokens),
        ("Request throughput (req/s):", metrics.request_throughput),
    ]
    if metrics.request_goodput is not None:
        rows.append(("Request goodput (req/s):", metrics.request_goodput))
    rows += [
        ("Output token throughput (tok/s):", metrics.output_throughput),
        ("Total Token throughput (tok/s):", metrics.total_token_throughput),
    ]
    lines += [_row(name, value) for name, value in rows]
    for attr, name, header in _LATENCIES:
        lines.append(header.center(_WIDTH, "-"))
        lines += _distribution_rows(name, getattr(metrics, attr))
    for kind, dist in metrics.ttft_ms_by_kind.items():
        lines.append(f"TTFT of {kind} requests".center(_WIDTH, "-"))
        lines += _distribution_rows(f"{kind} TTFT", dist)
    lines.append("=" * _WIDTH)
    lines += _failure_lines(records)
    return "\n".join(lines)


def _row(name: str, value: object) -> str:
    shown = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{name:<40} {shown:<10}"


def _distribution_rows(name: str, dist: Distribution) -> list[str]:
    return [
        _row(f"Mean {name} (ms):", dist.mean),
        _row(f"Median {name} (ms):", dist.median),
        _row(f"P90 {name} (ms):", dist.p90),
        _row(f"P99 {name} (ms):", dist.p99),
    ]


def _failure_lines(records: list[RequestRecord]) -> list[str]:
    errors = Counter(r.error for r in records if not r.success)
    if not errors:
        return []
    lines = [f"Failed requests by error ({sum(errors.values())}):"]
    for error, count in errors.most_common(_MAX_ERRORS_SHOWN):
        lines.append(f"  {count} x {error}")
    if len(errors) > _MAX_ERRORS_SHOWN:
        lines.append(f"  ... {len(errors) - _MAX_ERRORS_SHOWN} more kinds, see the result file")
    return lines
