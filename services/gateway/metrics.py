"""The gateway's Prometheus registry: requests as the client sees them (vLLM's TTFT, ITL,
end-to-end latency, tokens, finish reasons), admission state, where prompts were prefilled,
requests per worker, retries, migrations and pool sizes."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Histogram

from pdserve.core.spec_stats import SpecDecodeStats
from pdserve.gateway.admission import Admission
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.runtime.metrics import (
    Labels,
    RequestMetrics,
    SnapshotCollector,
    name,
    new_registry,
    spec_rows,
)

MIGRATION_REASONS = ("unavailable", "stalled", "error")
PREFILL_PLACES = (("remote", "prefill_remote"), ("local", "prefill_local"))
PREFILL_PLACES += (("fallback", "prefill_fallback"),)


class GatewayMetrics:
    """One gateway's series, labelled ``model_name`` and role="gateway"."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        admission: Admission,
        orchestrator: Orchestrator,
    ) -> None:
        self.admission = admission
        self.orchestrator = orchestrator
        self.registry = new_registry()
        self.labels = labels = Labels("gateway", model_name)
        self.requests = RequestMetrics(self.registry, labels, max_model_len)
        self.cached_tokens = Counter(
            name("prompt_tokens_cached"),
            "Prompt tokens of finished requests found in a worker's prefix cache.",
            labels.names,
            registry=self.registry,
        ).labels(*labels.values)
        self.params_n = Histogram(
            name("request_params_n"),
            "The n (choices) of each request.",
            labels.names,
            buckets=(1, 2, 5, 10, 20),
            registry=self.registry,
        ).labels(*labels.values)
        self.spec = SpecDecodeStats()
        self.registry.register(SnapshotCollector(labels, self._rows))

    def count_spec(self, counts) -> None:
        """Add a decode message's speculation (a ``SpecDecodeCounts``)."""
        self.spec.add(
            SpecDecodeStats(
                counts.num_drafts,
                counts.num_draft_tokens,
                counts.num_accepted_tokens,
                list(counts.accepted_per_pos),
            )
        )

    def _rows(self) -> Iterable[tuple]:
        a, c, router = self.admission, self.orchestrator.counters, self.orchestrator.router
        yield (
            "num_requests_running",
            "gauge",
            "Generations running through this gateway.",
            a.num_running,
        )
        yield (
            "num_requests_waiting",
            "gauge",
            "Requests queued for a generation slot.",
            a.num_waiting,
        )
        text = (
            "Prompts prefilled, by where: remote (the prefill pool), local (the decode worker, "
            "colocated or conditional) or fallback (the decode worker, no prefill worker could)."
        )
        for where, key in PREFILL_PLACES:
            yield ("prefill_requests", "counter", text, {"where": where}, c[key])
        text = "Calls retried on another worker after one was unreachable or hung unanswered."
        yield ("worker_retries", "counter", text, c["retries"])
        text = (
            "Decode streams moved to another decode worker after theirs broke, by reason: "
            "unavailable (died, unreachable), stalled (sent nothing for --stream-idle-timeout), "
            "error (failed)."
        )
        for reason in MIGRATION_REASONS:
            yield (
                "stream_migrations",
                "counter",
                text,
                {"reason": reason},
                c[f"migrations:{reason}"],
            )
        text = "Requests the router sent to each worker."
        for (role, worker_id), n in sorted(router.routed.items()):
            yield ("routed_requests", "counter", text, {"pool": role, "worker": worker_id}, n)
        yield from spec_rows(self.spec)
        text = "Live workers the gateway routes to, by pool."
        for role in ("prefill", "decode", "kvstore"):
            yield ("pool_workers", "gauge", text, {"pool": role}, len(router.pools.workers(role)))
