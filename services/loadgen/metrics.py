"""Serving metrics from per-request records, defined as vLLM's `vllm bench serve` defines them.

- TTFT: time from sending a request to its first streamed token chunk.
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for requests with more than one
  output token (a one-token request counts as TPOT 0 for goodput only).
- ITL: the gaps between successive token chunks' arrival, all requests pooled; a
  chunk that carries several tokens is one gap.
- E2EL: time from sending a request to its last byte.
- Throughputs divide by the benchmark's duration (first send to last answer).
- Goodput: requests per second that meet every given SLO (milliseconds, `<=`).

Failed requests count in `failed` and in no latency or token total.
Pure arithmetic: records in, metrics out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

SLO_KINDS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one request did; times in seconds, measured by the client."""

    session: int
    turn: int
    input_len: int
    expected_output_len: int
    kind: str = ""
    output_len: int = 0
    start: float = 0.0  # seconds after the benchmark began
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    success: bool = False
    status: int | None = None  # the HTTP status, when one came
    server_input_len: int | None = None  # the prompt tokens the server's usage reported
    error: str = ""


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency, in milliseconds."""

    mean: float
    median: float
    std: float
    p50: float
    p90: float
    p99: float
    count: int


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The aggregate result of a run."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    request_goodput: float | None  # requests/s meeting every SLO; None without SLOs
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    ttft_ms_by_kind: dict[str, Distribution]  # e.g. the short requests of long-short

    def to_dict(self) -> dict:
        return asdict(self)


def request_tpot(record: RequestRecord) -> float | None:
    """A successful request's time per output token after the first, or None (one token)."""
    if record.output_len <= 1:
        return None
    return (record.e2el - record.ttft) / (record.output_len - 1)


def distribution(values_s: list[float]) -> Distribution:
    """Mean, median, std and percentiles (numpy's linear interpolation) in ms; zeros if empty."""
    ms = np.asarray(values_s or [0.0], dtype=float) * 1000.0
    p50, p90, p99 = (float(np.percentile(ms, p)) for p in PERCENTILES)
    return Distribution(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        p50=p50,
        p90=p90,
        p99=p99,
        count=len(values_s),
    )


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request is within every SLO (vLLM: a one-token request's TPOT is 0)."""
    values_s = {"ttft": record.ttft, "tpot": request_tpot(record) or 0.0, "e2el": record.e2el}
    return all(values_s[kind] * 1000.0 <= limit for kind, limit in slos_ms.items())


def compute_metrics(
    records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None
) -> BenchmarkMetrics:
    """The aggregate metrics of `records`, run in `duration_s` seconds, against `slos_ms`."""
    if duration_s <= 0:
        raise ValueError(f"a benchmark's duration must be positive, got {duration_s}")
    unknown = set(slos_ms or {}) - set(SLO_KINDS)
    if unknown:
        raise ValueError(f"unknown SLO {sorted(unknown)}; use {', '.join(SLO_KINDS)}")
    ok = [r for r in records if r.success]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [t for t in map(request_tpot, ok) if t is not None]
    kinds = sorted({r.kind for r in ok if r.kind})
    goodput = None
    if slos_ms:
        goodput = sum(meets_slos(r, slos_ms) for r in ok) / duration_s
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=goodput,
        ttft_ms=distribution([r.ttft for r in ok]),
        tpot_ms=distribution(tpots),
        itl_ms=distribution([gap for r in ok for gap in r.itl]),
        e2el_ms=distribution([r.e2el for r in ok]),
        ttft_ms_by_kind={k: distribution([r.ttft for r in ok if r.kind == k]) for k in kinds},
    )
