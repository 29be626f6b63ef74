"""The gateway's settings: one frozen object, from flags and ``PDSERVE_*`` variables, checked."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.common.env import env_default
from services.common.registry import add_redis_args
from services.gateway.requests import DEFAULT_MAX_TOKENS


class SettingsError(ValueError):
    """A setting the gateway cannot start with; the message says what to change."""


@dataclass(frozen=True)
class GatewaySettings:
    """Where the gateway listens, which workers it sends to, and its limits."""

    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000  # the OpenAI REST API; 0: any free port, -1: off
    served_model_name: str | None = None  # None: the model directory's name
    prefill_addrs: tuple[str, ...] = field(default_factory=tuple)
    decode_addrs: tuple[str, ...] = field(default_factory=tuple)
    disaggregation: bool = True
    model: str | None = None  # a checkpoint dir; None: the default model
    max_model_len: int | None = None  # None: the model's limit
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 600.0
    drain_timeout_s: float = 10.0
    api_key: str | None = field(default=None, repr=False)  # None: the REST API is open
    max_body_bytes: int = 4 << 20
    max_concurrent_requests: int = 256  # REST requests generating at once
    max_queued_requests: int = 512  # REST requests waiting for one of those slots
    queue_timeout_s: float = 30.0  # longest wait for a slot before a 429
    redis_url: str | None = None  # pools from the registry instead of fixed addresses
    redis_prefix: str = "pdserve"
    routing: str = "prefix"
    route_prefix_weight: float = 1.0
    route_load_weight: float = 0.5
    local_prefill_threshold: int = 0  # tokens; 0: always disaggregate

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill_addrs", tuple(self.prefill_addrs))
        object.__setattr__(self, "decode_addrs", tuple(self.decode_addrs))
        if self.redis_url:
            _check(
                not self.decode_addrs and not self.prefill_addrs,
                "pass either --redis-url (the pools come from the registry) or --prefill/"
                "--decode addresses, not both",
            )
        elif not self.decode_addrs:
            raise SettingsError(
                "no decode worker: pass --decode HOST:PORT (repeat it for several workers), "
                "or --redis-url to find the workers registered there"
            )
        elif self.disaggregation and not self.prefill_addrs:
            raise SettingsError(
                "--disaggregation on needs a prefill worker: pass --prefill HOST:PORT, or use "
                "--disaggregation off to let decode workers prefill prompts themselves"
            )
        for address in (*self.prefill_addrs, *self.decode_addrs):
            _check_address(address)
        _check(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        _check(
            -1 <= self.http_port <= 65535,
            f"--http-port must be in [0, 65535], or -1 to turn the REST API off; got {self.http_port}",
        )
        _check(
            self.served_model_name is None or bool(self.served_model_name.strip()),
            "--served-model-name must not be empty",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 2,
            f"--max-model-len must be at least 2, got {self.max_model_len}",
        )
        _check(
            self.max_tokens_default >= 1,
            f"--max-tokens-default must be at least 1, got {self.max_tokens_default}",
        )
        _check(
            self.api_key is None or bool(self.api_key.strip()),
            "--api-key must not be empty (leave it unset for an open REST API)",
        )
        _check(
            self.max_body_bytes >= 1024,
            f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}",
        )
        _check(
            self.max_concurrent_requests >= 1,
            f"--max-concurrent-requests must be at least 1, got {self.max_concurrent_requests}",
        )
        _check(
            self.max_queued_requests >= 0,
            f"--max-queued-requests must be 0 or more, got {self.max_queued_requests}",
        )
        _check(
            self.routing in ("prefix", "round-robin"),
            f"--routing must be prefix or round-robin, got {self.routing!r}",
        )
        _check(
            self.route_prefix_weight >= 0 and self.route_load_weight >= 0,
            "--route-prefix-weight and --route-load-weight must be 0 or more",
        )
        _check(
            self.local_prefill_threshold >= 0,
            f"--local-prefill-threshold must be 0 or more, got {self.local_prefill_threshold}",
        )
        for flag, value in (
            ("--queue-timeout", self.queue_timeout_s),
            ("--prefill-timeout", self.prefill_timeout_s),
            ("--decode-timeout", self.decode_timeout_s),
            ("--drain-timeout", self.drain_timeout_s),
        ):
            _check(value > 0, f"{flag} must be a positive number of seconds, got {value}")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags; ``PDSERVE_<NAME>`` in the environment sets each default."""
    # argparse converts string defaults with `type`, so a bad variable fails like a bad flag.
    add = parser.add_argument
    add("--host", default=env_default("gateway_host", "127.0.0.1"), help="address to listen on")
    add("--port", type=int, default=env_default("gateway_port", "50051"), help="0: any free port")
    add(
        "--http-port",
        type=int,
        default=env_default("http_port", "8000"),
        help="port of the OpenAI REST API on the same host; 0: any free port, -1: off",
    )
    add(
        "--served-model-name",
        default=env_default("served_model_name"),
        help="the model name the REST API serves and expects (default: the model dir's name)",
    )
    add(
        "--prefill",
        action="append",
        metavar="HOST:PORT",
        help="a prefill worker (repeatable) [env PDSERVE_PREFILL, comma-separated]",
    )
    add(
        "--decode",
        action="append",
        metavar="HOST:PORT",
        help="a decode worker (repeatable) [env PDSERVE_DECODE, comma-separated]",
    )
    add(
        "--disaggregation",
        choices=["on", "off"],
        default=env_default("disaggregation", "on"),
        help="on: prefill on prefill workers, KV through the kvstore; off: decode workers do both",
    )
    add("--model", default=env_default("model"), help="checkpoint dir (default: SmolLM2)")
    add(
        "--max-model-len",
        type=int,
        default=env_default("max_model_len"),
        help="longest prompt + output in tokens (default: the model's limit)",
    )
    add(
        "--max-tokens-default",
        type=int,
        default=env_default("max_tokens_default", str(DEFAULT_MAX_TOKENS)),
        help="max_tokens of a request that leaves it unset",
    )
    add("--prefill-timeout", type=float, default=env_default("prefill_timeout", "60"))
    add("--decode-timeout", type=float, default=env_default("decode_timeout", "600"))
    add(
        "--drain-timeout",
        type=float,
        default=env_default("drain_timeout", "10"),
        help="seconds running requests get to finish on SIGTERM",
    )
    add(
        "--api-key",
        default=env_default("api_key"),
        help="require 'Authorization: Bearer KEY' on the REST API's /v1 routes (default: open)",
    )
    add(
        "--max-body-bytes",
        type=int,
        default=env_default("max_body_bytes", str(4 << 20)),
        help="largest REST request body; a larger one gets 413",
    )
    add(
        "--max-concurrent-requests",
        type=int,
        default=env_default("max_concurrent_requests", "256"),
        help="REST requests generating at once; more wait in the queue",
    )
    add(
        "--max-queued-requests",
        type=int,
        default=env_default("max_queued_requests", "512"),
        help="REST requests waiting for a slot; past that, 429 with Retry-After",
    )
    add(
        "--queue-timeout",
        type=float,
        default=env_default("queue_timeout", "30"),
        help="seconds a queued REST request waits for a slot before a 429",
    )

    g = parser.add_argument_group("routing")
    add_redis_args(
        g,
        "take the prefill, decode and kvstore pools from the registry in this Redis instead "
        "of --prefill/--decode",
    )
    g.add_argument(
        "--routing",
        choices=["prefix", "round-robin"],
        default=env_default("routing", "prefix"),
        help="prefix: the lowest prefix_weight*uncached_blocks + load_weight*load_blocks "
        "(see services/gateway/router.py); round-robin: in turn",
    )
    g.add_argument(
        "--route-prefix-weight",
        type=float,
        default=env_default("route_prefix_weight", "1.0"),
        help="cost of a prompt block the worker's prefix cache lacks",
    )
    g.add_argument(
        "--route-load-weight",
        type=float,
        default=env_default("route_load_weight", "0.5"),
        help="cost of a KV block in use on the worker",
    )
    g.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=env_default("local_prefill_threshold", "0"),
        help="conditional disaggregation: a prompt whose uncached part on the chosen decode "
        "worker is shorter than this many tokens is prefilled there, skipping the prefill "
        "pool; 0: always use the prefill pool",
    )


def settings_from(ns: argparse.Namespace) -> GatewaySettings:
    """Settings from parsed flags; raises SettingsError saying what to change."""
    return GatewaySettings(
        host=ns.host,
        port=ns.port,
        http_port=ns.http_port,
        served_model_name=ns.served_model_name,
        prefill_addrs=tuple(ns.prefill or _env_list("prefill")),
        decode_addrs=tuple(ns.decode or _env_list("decode")),
        disaggregation=ns.disaggregation == "on",
        model=ns.model,
        max_model_len=ns.max_model_len,
        max_tokens_default=ns.max_tokens_default,
        prefill_timeout_s=ns.prefill_timeout,
        decode_timeout_s=ns.decode_timeout,
        drain_timeout_s=ns.drain_timeout,
        api_key=ns.api_key,
        max_body_bytes=ns.max_body_bytes,
        max_concurrent_requests=ns.max_concurrent_requests,
        max_queued_requests=ns.max_queued_requests,
        queue_timeout_s=ns.queue_timeout,
        redis_url=ns.redis_url,
        redis_prefix=ns.redis_prefix,
        routing=ns.routing,
        route_prefix_weight=ns.route_prefix_weight,
        route_load_weight=ns.route_load_weight,
        local_prefill_threshold=ns.local_prefill_threshold,
    )


def _env_list(name: str) -> list[str]:
    value = env_default(name) or ""
    return [item.strip() for item in value.split(",") if item.strip()]


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    _check(
        bool(host) and port.isdigit(),
        f"worker address {address!r} is not HOST:PORT (e.g. 127.0.0.1:50061)",
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)
