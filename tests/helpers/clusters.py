"""The clusters tests serve from, as real processes: a decode worker with a gateway that
sends it whole requests (colocated), or a kvstore, a prefill and a decode worker behind a
gateway (disaggregated). A test with another shape starts its services with the same
pieces (``running``, ``start_kvstore``) and ``Cluster.start_many``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from pdserve.local.launcher import Child
from pdserve.testing.cluster import Cluster
from tests.helpers.flags import ENGINE


@contextmanager
def running(log_dir: Path) -> Iterator[Cluster]:
    """A Cluster logging to ``log_dir`` whose processes are all stopped when the block ends."""
    cluster = Cluster(log_dir)
    try:
        yield cluster
    finally:
        cluster.stop_all()


def rest_address(cluster: Cluster, gateway: str = "gateway") -> str:
    """HOST:PORT of the REST API of the started gateway called ``gateway``."""
    child = next(s for s in cluster.services if s.name == gateway)
    return child.addresses["gateway-http"]


def start_kvstore(
    cluster: Cluster,
    *args: str,
    capacity: str = "64MiB",
    env: dict[str, str] | None = None,
) -> list[str]:
    """Start a kvstore called ``kvstore``; the flags that point a worker at it."""
    kvstore = cluster.start(
        "kvstore", "pdserve.kvstore", "--capacity-bytes", capacity, *args, env=env
    )
    return ["--kvstore", kvstore.address]


def start_colocated(
    cluster: Cluster,
    model: Path,
    *,
    engine: Sequence[str] = ENGINE,
    gateway: Sequence[str] = (),
) -> Child:
    """A decode worker (``decode``) and a gateway (``gateway``, flags ``gateway`` added)
    that prefills on it too; the gateway."""
    served = ["--model", str(model)]
    decode = cluster.start("decode", "pdserve.decode", *served, *engine)
    return cluster.start(
        "gateway",
        "pdserve.gateway",
        *("--decode", decode.address, "--disaggregation", "off"),
        *gateway,
        *served,
    )


def start_disaggregated(
    cluster: Cluster,
    model: Path,
    *,
    engine: Sequence[str] = ENGINE,
    capacity: str = "64MiB",
    internal: Sequence[str] = (),
    decode: Sequence[str] = (),
    gateway: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Child:
    """A kvstore of ``capacity``, a prefill and a decode worker (started together) and a
    gateway over them, named by their roles; the gateway. ``internal``: flags of the kvstore
    and both workers (TLS, tracing); ``decode``: the decode worker's own; ``gateway``: the
    gateway's; ``env``: added to every service's environment."""
    served = ["--model", str(model)]
    known = start_kvstore(cluster, *internal, capacity=capacity, env=env)
    prefill_worker, decode_worker = cluster.start_many(
        ("prefill", "pdserve.prefill", *known, *served, *engine, *internal),
        ("decode", "pdserve.decode", *known, *served, *engine, *decode, *internal),
        env=env,
    )
    return cluster.start(
        "gateway",
        "pdserve.gateway",
        *("--prefill", prefill_worker.address, "--decode", decode_worker.address),
        *gateway,
        *served,
        env=env,
    )


def start_hf_server(cluster: Cluster, model: Path, *, batch_wait_ms: int) -> Child:
    """The transformers baseline (bench/serving/hf_server.py) on ``model`` as ``hf-server``:
    one thread, batches of up to 4 gathered for ``batch_wait_ms``."""
    return cluster.start(
        "hf-server",
        "bench.serving.hf_server",
        *("--model", str(model), "--num-threads", "1", "--max-batch-size", "4"),
        *("--batch-wait-ms", str(batch_wait_ms)),
        timeout=60,
    )
