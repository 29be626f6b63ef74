"""The kvstore's command line: settings from flags and PDSERVE_KVSTORE_* variables, then serve."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_DEFAULTS = {"host": "127.0.0.1", "port": "50061", "capacity_bytes": "2GiB"}
_HELP = {
    "host": "address to listen on",
    "port": "port to listen on; 0 picks a free one (printed in the READY line)",
    "capacity_bytes": "memory for blocks, e.g. 512MiB or 2GiB; least recently used out first",
}


@dataclass(frozen=True)
class KVStoreSettings:
    """Everything that shapes a kvstore process."""

    host: str
    port: int
    capacity_bytes: int
    redis_url: str | None = None
    redis_prefix: str = "pdserve"
    registry_ttl_s: float = 5.0
    advertise_address: str | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("--host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        if self.capacity_bytes < 1:
            raise ValueError(f"--capacity-bytes must be positive, got {self.capacity_bytes}")


def add_kvstore_args(parser: argparse.ArgumentParser) -> None:
    """One flag per KVStoreSettings field; ``PDSERVE_KVSTORE_<FIELD>`` sets its default."""
    for name, default in _DEFAULTS.items():
        env = "PDSERVE_KVSTORE_" + name.upper()
        parser.add_argument(
            "--" + name.replace("_", "-"),
            default=os.environ.get(env, default),
            help=f"{_HELP[name]} [env {env}; default: {default}]",
        )
    from services.common.registry import add_registry_args

    add_registry_args(parser)


def settings_from(ns: argparse.Namespace) -> KVStoreSettings:
    """KVStoreSettings from parsed flags; a bad value raises ValueError saying what to change."""
    from services.common.sizes import parse_size

    try:
        port = int(ns.port)
    except ValueError:
        raise ValueError(f"--port must be an integer, got {ns.port!r}") from None
    try:
        capacity = parse_size(ns.capacity_bytes)
    except ValueError as e:
        raise ValueError(f"--capacity-bytes: {e}") from None
    return KVStoreSettings(
        host=ns.host,
        port=port,
        capacity_bytes=capacity,
        redis_url=ns.redis_url,
        redis_prefix=ns.redis_prefix,
        registry_ttl_s=ns.registry_ttl,
        advertise_address=ns.advertise_address,
    )


def _publisher(settings: KVStoreSettings):
    """Makes the kvstore's registry publisher once its address is known (None: no Redis)."""
    if not settings.redis_url:
        return None
    from services.common.registry import RegistryPublisher, WorkerInfo, new_worker_id

    def make(address: str, store) -> RegistryPublisher:
        async def load() -> dict:
            return {"bytes_used": store.bytes_used, "num_cached_blocks": store.num_blocks}

        info = WorkerInfo(
            worker_id=new_worker_id("kvstore"),
            role="kvstore",
            address=settings.advertise_address or address,
            capacity_bytes=store.capacity_bytes,
        )
        return RegistryPublisher(
            settings.redis_url,
            info,
            load=load,
            ttl_s=settings.registry_ttl_s,
            prefix=settings.redis_prefix,
        )

    return make


def _print_ready(address: str) -> None:
    # Launchers (tests, `pdserve up`) wait for exactly this line on stdout.
    print(f"READY kvstore {address}", flush=True)


def run(settings: KVStoreSettings) -> int:
    """Serve until SIGTERM or SIGINT; print the READY line once the server accepts calls."""
    logger.info("kvstore settings: %s", settings)
    from services.kvstore.server import serve

    try:
        asyncio.run(
            serve(
                settings.host,
                settings.port,
                settings.capacity_bytes,
                _print_ready,
                registry=_publisher(settings),
            )
        )
    except OSError as e:
        print(f"kvstore: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m services.kvstore``."""
    parser = argparse.ArgumentParser(
        prog="python -m services.kvstore", description="Serve the pdserve KV block store."
    )
    add_kvstore_args(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from(ns)
    except ValueError as e:
        print(f"kvstore: error: {e}", file=sys.stderr)
        return 2
    return run(settings)
