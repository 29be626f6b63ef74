"""Write deploy/grafana/pdserve.json, the operator's Grafana dashboard of a pdserve cluster.

    python deploy/grafana/dashboard.py

Every series it reads is one pdserve exposes (docs/observability.md); the `role` label
tells the pools apart (gateway, prefill, decode, kvstore). tests/integration/test_metrics.py
checks each query against a running cluster's /metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("pdserve.json")
M = 'model_name=~"$model_name"'
RATE = "[$__rate_interval]"


def rate(metric: str, selector: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}{RATE}))"


def quantile(metric: str, q: float, selector: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {rate(metric + '_bucket', selector, ', '.join(['le', *filter(None, [by])]))})"


def ratio(part: str, whole: str) -> str:
    return f"{part} / clamp_min({whole}, 1e-9)"


def p50_p99(metric: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        (quantile(metric, 0.5, selector, by), "p50" + suffix),
        (quantile(metric, 0.99, selector, by), "p99" + suffix),
    ]


GATEWAY = f'role="gateway",{M}'
POOLS = f'role=~"prefill|decode",{M}'
KVSTORE = 'role="kvstore"'
# Not by $model_name: the planner's model_name is its profile's model, which need not be the
# name the gateways serve it by.
PLANNER = 'role="planner"'

ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Requests, as clients see them (gateway)",
        [
            (
                "Requests / s by finish reason",
                "reqps",
                [
                    (
                        rate("pdserve:request_success_total", GATEWAY, "finished_reason"),
                        "{{finished_reason}}",
                    )
                ],
            ),
            (
                "Token throughput",
                "short",
                [
                    (rate("pdserve:generation_tokens_total", GATEWAY), "generated tokens / s"),
                    (rate("pdserve:prompt_tokens_total", GATEWAY), "prompt tokens / s"),
                ],
            ),
            ("Time to first token", "s", p50_p99("pdserve:time_to_first_token_seconds", GATEWAY)),
            (
                "Time per output token",
                "s",
                p50_p99("pdserve:request_time_per_output_token_seconds", GATEWAY),
            ),
            ("Inter-token latency", "s", p50_p99("pdserve:inter_token_latency_seconds", GATEWAY)),
            ("End-to-end latency", "s", p50_p99("pdserve:e2e_request_latency_seconds", GATEWAY)),
            (
                "Admission: running and queued",
                "short",
                [
                    (f"sum (pdserve:num_requests_running{{{GATEWAY}}})", "running"),
                    (f"sum (pdserve:num_requests_waiting{{{GATEWAY}}})", "waiting"),
                ],
            ),
            (
                "Admission wait",
                "s",
                p50_p99("pdserve:request_queue_time_seconds", GATEWAY),
            ),
        ],
    ),
    (
        "Pools: which one is short",
        [
            (
                "Pool sizes",
                "short",
                [(f"max by (pool) (pdserve:pool_workers{{{GATEWAY}}})", "{{pool}}")],
            ),
            (
                "Time to first token by pool",
                "s",
                p50_p99("pdserve:time_to_first_token_seconds", POOLS, "role"),
            ),
            (
                "Time per output token by pool",
                "s",
                p50_p99("pdserve:request_time_per_output_token_seconds", POOLS, "role"),
            ),
            (
                "Inter-token latency by pool",
                "s",
                p50_p99("pdserve:inter_token_latency_seconds", POOLS, "role"),
            ),
            (
                "Queued requests by pool",
                "short",
                [(f"sum by (role) (pdserve:num_requests_waiting{{{M}}})", "{{role}}")],
            ),
            (
                "Running requests by pool",
                "short",
                [(f"sum by (role) (pdserve:num_requests_running{{{M}}})", "{{role}}")],
            ),
            (
                "Queue time by pool",
                "s",
                p50_p99("pdserve:request_queue_time_seconds", POOLS, "role"),
            ),
            (
                "Prefill and decode time by pool",
                "s",
                [
                    (
                        quantile("pdserve:request_prefill_time_seconds", 0.99, POOLS, "role"),
                        "prefill p99 {{role}}",
                    ),
                    (
                        quantile("pdserve:request_decode_time_seconds", 0.99, POOLS, "role"),
                        "decode p99 {{role}}",
                    ),
                ],
            ),
        ],
    ),
    (
        "Planner (autoscaling.mode planner)",
        [
            (
                "Replicas by pool: desired and current",
                "short",
                [
                    (
                        f"max by (pool) (pdserve:planner_desired_replicas{{{PLANNER}}})",
                        "desired {{pool}}",
                    ),
                    (
                        f"max by (pool) (pdserve:planner_current_replicas{{{PLANNER}}})",
                        "current {{pool}}",
                    ),
                ],
            ),
            (
                "p90 time to first token: predicted and seen",
                "s",
                [
                    (
                        f"max (pdserve:planner_predicted_ttft_seconds{{{PLANNER}}})",
                        "predicted at the desired replicas",
                    ),
                    (
                        quantile("pdserve:time_to_first_token_seconds", 0.9, GATEWAY),
                        "seen (gateway)",
                    ),
                ],
            ),
            (
                "p90 inter-token latency: predicted and seen",
                "s",
                [
                    (
                        f"max (pdserve:planner_predicted_itl_seconds{{{PLANNER}}})",
                        "predicted at the desired replicas",
                    ),
                    (
                        quantile("pdserve:inter_token_latency_seconds", 0.9, GATEWAY),
                        "seen (gateway)",
                    ),
                ],
            ),
            (
                "Request rate the planner sees",
                "reqps",
                [
                    (
                        f"max (pdserve:planner_observed_request_rate{{{PLANNER}}})",
                        "over its window",
                    )
                ],
            ),
            (
                "Scaling decisions (5 min) by pool, direction and reason",
                "short",
                [
                    (
                        "sum by (pool, direction, reason) "
                        f'(increase(pdserve:planner_decisions_total{{{PLANNER},direction!="hold"}}[5m]))',
                        "{{pool}} {{direction}} ({{reason}})",
                    )
                ],
            ),
        ],
    ),
    (
        "KV cache",
        [
            (
                "KV cache use by pool",
                "percentunit",
                [
                    (f"avg by (role) (pdserve:kv_cache_usage_perc{{{M}}})", "mean {{role}}"),
                    (f"max by (role) (pdserve:kv_cache_usage_perc{{{M}}})", "max {{role}}"),
                ],
            ),
            (
                "Prefix cache hit rate by pool",
                "percentunit",
                [
                    (
                        ratio(
                            rate("pdserve:prefix_cache_hits_total", M, "role"),
                            rate("pdserve:prefix_cache_queries_total", M, "role"),
                        ),
                        "{{role}}",
                    ),
                    (
                        ratio(
                            rate("pdserve:prompt_tokens_cached_total", GATEWAY),
                            rate("pdserve:prompt_tokens_total", GATEWAY),
                        ),
                        "prompt tokens served from cache (gateway)",
                    ),
                ],
            ),
            (
                "Preemptions / s by pool",
                "short",
                [(rate("pdserve:num_preemptions_total", M, "role"), "{{role}}")],
            ),
        ],
    ),
    (
        "KV transfer and kvstore",
        [
            (
                "Transfer bandwidth",
                "Bps",
                [(rate("pdserve:kv_transfer_bytes_total", M, "direction"), "{{direction}}")],
            ),
            (
                "Transfer time per request",
                "s",
                p50_p99("pdserve:kv_transfer_seconds", M, "direction"),
            ),
            (
                "Failed transfers / s (their blocks recomputed)",
                "short",
                [(rate("pdserve:kv_transfer_failures_total", M, "direction"), "{{direction}}")],
            ),
            (
                "kvstore memory",
                "percentunit",
                [
                    (
                        ratio(
                            "sum (pdserve:kvstore_bytes_used)",
                            "sum (pdserve:kvstore_capacity_bytes)",
                        ),
                        "used / capacity",
                    )
                ],
            ),
            (
                "kvstore blocks / s",
                "short",
                [
                    (rate("pdserve:kvstore_blocks_in_total", KVSTORE), "in"),
                    (rate("pdserve:kvstore_blocks_out_total", KVSTORE), "out"),
                    (rate("pdserve:kvstore_evictions_total", KVSTORE), "evicted"),
                    (rate("pdserve:kvstore_expired_total", KVSTORE), "expired"),
                    (rate("pdserve:kv_blocks_rejected_total", M), "rejected by decode"),
                ],
            ),
            (
                "kvstore hit rate",
                "percentunit",
                [
                    (
                        ratio(
                            rate("pdserve:kvstore_hits_total", KVSTORE),
                            f"({rate('pdserve:kvstore_hits_total', KVSTORE)} + "
                            f"{rate('pdserve:kvstore_misses_total', KVSTORE)})",
                        ),
                        "hits / asked",
                    )
                ],
            ),
        ],
    ),
    (
        "Routing",
        [
            (
                "Where prompts were prefilled",
                "reqps",
                [(rate("pdserve:prefill_requests_total", GATEWAY, "where"), "{{where}}")],
            ),
            (
                "Requests routed to each worker",
                "reqps",
                [
                    (
                        rate("pdserve:routed_requests_total", GATEWAY, "pool, worker"),
                        "{{pool}} {{worker}}",
                    )
                ],
            ),
            (
                "Migrations and retries",
                "short",
                [
                    (
                        rate("pdserve:stream_migrations_total", GATEWAY, "reason"),
                        "migrated: {{reason}}",
                    ),
                    (rate("pdserve:worker_retries_total", GATEWAY), "retried"),
                ],
            ),
        ],
    ),
    (
        "Speculative decoding",
        [
            (
                "Draft acceptance rate",
                "percentunit",
                [
                    (
                        ratio(
                            rate("pdserve:spec_decode_num_accepted_tokens_total", GATEWAY),
                            rate("pdserve:spec_decode_num_draft_tokens_total", GATEWAY),
                        ),
                        "accepted / proposed",
                    )
                ],
            ),
            (
                "Tokens per verification (mean acceptance length)",
                "short",
                [
                    (
                        "1 + "
                        + ratio(
                            rate("pdserve:spec_decode_num_accepted_tokens_total", GATEWAY),
                            rate("pdserve:spec_decode_num_drafts_total", GATEWAY),
                        ),
                        "mean acceptance length",
                    )
                ],
            ),
            (
                "Proposed and accepted tokens",
                "short",
                [
                    (rate("pdserve:spec_decode_num_draft_tokens_total", GATEWAY), "proposed"),
                    (rate("pdserve:spec_decode_num_accepted_tokens_total", GATEWAY), "accepted"),
                ],
            ),
        ],
    ),
    (
        "Processes",
        [
            (
                "CPU by process",
                "percentunit",
                [(rate("process_cpu_seconds_total", "", "job, instance"), "{{job}} {{instance}}")],
            ),
            (
                "Resident memory by process",
                "bytes",
                [
                    (
                        "sum by (job, instance) (process_resident_memory_bytes)",
                        "{{job}} {{instance}}",
                    )
                ],
            ),
        ],
    ),
]


def panel(panel_id: int, title: str, unit: str, targets, x: int, y: int) -> dict:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    panels, panel_id, y = [], 1, 0
    for title, row in ROWS:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y = panel_id + 1, y + 1
        for i, (name, unit, targets) in enumerate(row):
            panels.append(panel(panel_id, name, unit, targets, 8 * (i % 3), y + 8 * (i // 3)))
            panel_id += 1
        y += 8 * -(-len(row) // 3)
    return {
        "title": "pdserve",
        "uid": "pdserve",
        "description": "A pdserve cluster by pool: latency, throughput, queues, the "
        "planner's decisions, KV cache, KV transfer, routing (docs/observability.md).",
        "tags": ["pdserve", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                },
                {
                    "name": "model_name",
                    "type": "query",
                    "label": "model",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {
                        "query": "label_values(pdserve:num_requests_running, model_name)",
                        "refId": "model_name",
                    },
                    "definition": "label_values(pdserve:num_requests_running, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }


def main() -> None:
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
