"""`pdserve status`: the registry in Redis, read once, as a table per pool (or JSON)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from pdserve.controlplane.registry import ROLES, WorkerInfo
from pdserve.controlplane.signing import Verifier
from pdserve.controlplane.view import RegistryView
from pdserve.core.errors import SettingsError
from pdserve.local.cluster_state import running_clusters, state_dir
from pdserve.runtime.logs import configure_logging
from pdserve.runtime.trust_files import read_token
from pdserve.settings.commands import StatusSettings
from pdserve.settings.flags import parse_settings
from pdserve.settings.process import InternalSecuritySettings, RedisSettings
from pdserve.settings.redaction import redact_url


async def read_workers(
    url: str, prefix: str, verifier: Verifier | None = None
) -> tuple[list[WorkerInfo], dict[str, str]]:
    """Live registry entries, and those ``verifier`` refused ({key: why}: what gateways
    leave out too); ConnectionError when Redis does not answer."""
    view = RegistryView(url, prefix=prefix, verifier=verifier or Verifier())
    try:
        await view.refresh()
        if not view.redis_ok:
            raise ConnectionError(f"Redis at {redact_url(url)} does not answer")
        return view.workers(), view.refused
    finally:
        await view.close()


def pool_totals(workers: list[WorkerInfo]) -> dict[str, int]:
    """Sums over one pool's workers."""
    names = (
        "num_running",
        "num_waiting",
        "num_total_blocks",
        "active_blocks",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "bytes_used",
        "capacity_bytes",
        "requests_total",
        "spec_num_drafts",
        "spec_num_draft_tokens",
        "spec_num_accepted_tokens",
    )
    return {"workers": len(workers), **{n: sum(getattr(w, n) for w in workers) for n in names}}


def status_json(workers: list[WorkerInfo], now: float) -> dict:
    """Each pool's entries (with ``heartbeat_age_s``) and totals."""
    pools = {}
    for role in ROLES:
        members = [w for w in workers if w.role == role]
        entries = [
            {**dataclasses.asdict(w), "heartbeat_age_s": round(now - w.updated_at, 3)}
            for w in members
        ]
        pools[role] = {"workers": entries, "totals": pool_totals(members)}
    return {"pools": pools}


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _row(role: str, w: WorkerInfo | dict, now: float) -> list[str]:
    """One table row: a worker, or a pool's totals (a dict from ``pool_totals``)."""
    if isinstance(w, dict):
        ident, address, model, tp, age = f"total ({w['workers']})", "", "", "", ""
        get = w.__getitem__
    else:
        ident, address, model = w.worker_id, w.address, w.model
        tp, age = str(w.tensor_parallel_size), f"{now - w.updated_at:.1f}s"
        get = w.__getattribute__
    if role == "kvstore":
        used, cap = get("bytes_used"), get("capacity_bytes")
        return [ident, address, f"{_size(used)} / {_size(cap)} ({_pct(used, cap)})", age]
    used, total = get("active_blocks"), get("num_total_blocks")
    hits, queries = get("prefix_cache_hits"), get("prefix_cache_queries")
    accepted, drafted = get("spec_num_accepted_tokens"), get("spec_num_draft_tokens")
    return [
        ident,
        address,
        model,
        tp,
        str(get("num_running")),
        str(get("num_waiting")),
        f"{used}/{total} ({_pct(used, total)})",
        f"{_pct(hits, queries)} ({hits}/{queries})",
        f"{_pct(accepted, drafted)} ({accepted}/{drafted})" if drafted else "-",
        age,
    ]


_HEADERS = {
    "worker": [
        "id",
        "address",
        "model",
        "TP",
        "running",
        "waiting",
        "KV blocks",
        "prefix hits (tokens)",
        "spec accepted (tokens)",
        "age",
    ],
    "kvstore": ["id", "address", "bytes used / capacity", "age"],
}


def format_tables(workers: list[WorkerInfo], now: float) -> str:
    """A table per pool, with a totals row; ``age`` is the time since the last heartbeat."""
    out = []
    for role in ROLES:
        members = [w for w in workers if w.role == role]
        out.append(f"{role} ({len(members)})")
        if not members:
            out.append("  (none registered)\n")
            continue
        rows = [_HEADERS["kvstore" if role == "kvstore" else "worker"]]
        rows += [_row(role, w, now) for w in members] + [_row(role, pool_totals(members), now)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            out.append(
                "  " + "  ".join(c.ljust(wd) for c, wd in zip(row, widths, strict=True)).rstrip()
            )
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """`pdserve status`: print the registry once; exit 1 when Redis does not answer."""
    settings = parse_settings(
        StatusSettings,
        argv,
        prog="pdserve status",
        description="Read the registry in Redis once and print a table per pool (prefill, "
        "decode, kvstore): address, model, tensor-parallel size (TP), running and waiting "
        "requests, KV blocks in use, prefix cache hits, kvstore bytes, and the age of each "
        "entry's last heartbeat. "
        "Without --redis-url, the cluster `pdserve up` runs on this machine (the newest, "
        "when several run).",
    )
    configure_logging(settings.log)
    redis, cluster = settings.redis, None
    if not redis.redis_url:
        clusters = running_clusters()
        if not clusters:
            print(
                "pdserve status: error: no --redis-url, and no cluster started by `pdserve up` "
                f"runs on this machine (none in {state_dir()})",
                file=sys.stderr,
            )
            return 1
        cluster = clusters[0]
        redis = RedisSettings(cluster.redis_url, cluster.redis_prefix)
    given = settings.security
    try:
        token = read_token(
            InternalSecuritySettings(
                internal_token=given.internal_token, internal_token_file=given.internal_token_file
            )
        )
    except SettingsError as e:
        print(f"pdserve status: error: {e}", file=sys.stderr)
        return 2
    verifier = Verifier.for_tokens(token) if token else None
    try:
        workers, refused = asyncio.run(read_workers(redis.redis_url, redis.redis_prefix, verifier))
    except ConnectionError as e:
        print(f"pdserve status: error: {e}; is the cluster up?", file=sys.stderr)
        return 1
    now = time.time()
    if settings.json_output:
        body = {"redis_url": redact_url(redis.redis_url), **status_json(workers, now)}
        body["verified"] = verifier is not None
        body["refused"] = refused
        if cluster is not None:
            body["cluster"] = {
                "up_pid": cluster.pid,
                "gateway": cluster.gateway,
                "rest": cluster.rest,
                "log_dir": cluster.log_dir,
            }
        print(json.dumps(body, indent=2))
    else:
        if cluster is not None:
            rest = f", REST {cluster.rest}" if cluster.rest else ""
            print(f"cluster of `pdserve up` (pid {cluster.pid}): gRPC {cluster.gateway}{rest}\n")
        print(format_tables(workers, now), end="")
        if verifier is None:
            print("(not verified: with the internal token, entries gateways refuse show apart)")
        for key, why in sorted(refused.items()):
            print(f"REFUSED {key}: {why}; gateways do not route to it")
    return 0
