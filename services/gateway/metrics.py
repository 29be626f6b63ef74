"""The gateway's Prometheus text: admission state, where prompts were prefilled, requests
per worker, retries and pool sizes."""

from __future__ import annotations

from services.gateway.admission import Admission
from services.gateway.orchestrator import Orchestrator


def gateway_metrics(admission: Admission, orchestrator: Orchestrator, model_name: str) -> str:
    """The body of GET /metrics."""
    m = f'model_name="{model_name}"'
    lines = [
        "# HELP pdserve:num_requests_running Generations running through this gateway.",
        "# TYPE pdserve:num_requests_running gauge",
        f"pdserve:num_requests_running{{{m}}} {admission.num_running}",
        "# HELP pdserve:num_requests_waiting Requests queued for a generation slot.",
        "# TYPE pdserve:num_requests_waiting gauge",
        f"pdserve:num_requests_waiting{{{m}}} {admission.num_waiting}",
    ]
    return "\n".join(lines + routing_metrics(orchestrator, model_name)) + "\n"


def routing_metrics(orchestrator: Orchestrator, model_name: str) -> list[str]:
    """Prometheus lines: where prompts were prefilled, requests per worker, retries, pools."""
    c, m = orchestrator.counters, f'model_name="{model_name}"'
    lines = [
        "# HELP pdserve:prefill_requests_total Prompts prefilled, by where: remote (the "
        "prefill pool), local (the decode worker, colocated or conditional) or fallback "
        "(the decode worker, no prefill worker could).",
        "# TYPE pdserve:prefill_requests_total counter",
        f'pdserve:prefill_requests_total{{{m},where="remote"}} {c["prefill_remote"]}',
        f'pdserve:prefill_requests_total{{{m},where="local"}} {c["prefill_local"]}',
        f'pdserve:prefill_requests_total{{{m},where="fallback"}} {c["prefill_fallback"]}',
        "# HELP pdserve:worker_retries_total Calls retried on another worker after one was "
        "unreachable, or hung before its first answer.",
        "# TYPE pdserve:worker_retries_total counter",
        f"pdserve:worker_retries_total{{{m}}} {c['retries']}",
        "# HELP pdserve:stream_migrations_total Decode streams moved to another decode "
        "worker after theirs broke, by reason: unavailable (died, unreachable), stalled "
        "(sent nothing for --stream-idle-timeout), error (failed).",
        "# TYPE pdserve:stream_migrations_total counter",
        *(
            f'pdserve:stream_migrations_total{{{m},reason="{r}"}} {c["migrations:" + r]}'
            for r in ("unavailable", "stalled", "error")
        ),
        "# HELP pdserve:routed_requests_total Requests the router sent to each worker.",
        "# TYPE pdserve:routed_requests_total counter",
    ]
    router = orchestrator.router
    for (role, worker_id), n in sorted(router.routed.items()):
        lines.append(f'pdserve:routed_requests_total{{{m},pool="{role}",worker="{worker_id}"}} {n}')
    lines += [
        "# HELP pdserve:pool_workers Live workers the gateway routes to, by pool.",
        "# TYPE pdserve:pool_workers gauge",
    ]
    for role in ("prefill", "decode", "kvstore"):
        lines.append(f'pdserve:pool_workers{{{m},pool="{role}"}} {len(router.pools.workers(role))}')
    return lines
