"""The settings of every pdserve service, one frozen dataclass each (see ``flags``).

They live together, free of torch, because they cross process boundaries: ``pdserve up``
turns them into its children's flags, a gateway reads the same ``PDSERVE_*`` variables
as the workers beside it, and one list of them (``commands.ALL_SETTINGS``) tells a
misspelled variable from a setting of another command. Every service's settings start
with its ``server`` group and end with ``log``, so every ``--help`` reads the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from pdserve.core.sampling import MAX_LOGPROBS
from pdserve.settings.engine import EngineArgs
from pdserve.settings.flags import check, setting
from pdserve.settings.process import (
    InternalSecuritySettings,
    LogSettings,
    MetricsSettings,
    RedisSettings,
    RegistrySettings,
    ServerSettings,
    TracingSettings,
    check_address,
    server,
)
from pdserve.settings.sizes import parse_size, size_setting

MAX_N = 128  # the most choices --max-n may allow


@dataclass(frozen=True)
class WatchdogSettings:
    """When a worker counts its engine as dead, and leaves to be restarted."""

    GROUP: ClassVar[str] = "watchdog"

    engine_stall_timeout: float = setting(
        60.0,
        "seconds one engine step (or other call on the engine thread) may run before the "
        "engine counts as stalled: the worker then fails its requests with UNAVAILABLE, "
        "turns NOT_SERVING, deregisters and exits 3, for its supervisor to restart it (as "
        "when the engine thread dies); generous, since a first step may compile",
    )

    def __post_init__(self) -> None:
        check(
            self.engine_stall_timeout > 0,
            f"--engine-stall-timeout must be a positive number of seconds, got "
            f"{self.engine_stall_timeout}",
        )


@dataclass(frozen=True)
class KVTransportSettings:
    """How a prompt's KV blocks go from the prefill worker to the decode worker."""

    GROUP: ClassVar[str] = "kv transport"

    kv_transport: str = setting(
        "auto",
        "how KV blocks travel between prefill and decode workers: nixl (the decode worker "
        "reads them straight from the prefill worker's memory over NIXL: UCX's shared "
        "memory, RDMA or TCP; needs the `pdserve[nixl]` extra and --redis-url, through "
        "which the workers find each other's NIXL agents), grpc (through the kvstore), or "
        "auto (nixl where it loads and the peer offers it, else grpc; the choice is "
        "logged once). The kvstore stays the fallback and the shared prefix tier either way",
        choices=("auto", "nixl", "grpc"),
    )
    nixl_buffer_bytes: str = setting(
        "512MiB",
        "bytes of memory registered with NIXL for blocks in flight: on a prefill worker, "
        "the blocks waiting for their decode worker's read (held until read, at most "
        "60 s); on a decode worker, the blocks landing before their import. A request "
        "that does not fit goes through the kvstore",
    )

    def __post_init__(self) -> None:
        check(
            size_setting("--nixl-buffer-bytes", self.nixl_buffer_bytes) >= 1 << 20,
            f"--nixl-buffer-bytes must be at least 1MiB, got {self.nixl_buffer_bytes}",
        )

    @property
    def nixl_buffer_size(self) -> int:
        return parse_size(self.nixl_buffer_bytes)


@dataclass(frozen=True)
class PrefillSettings:
    """A prefill worker."""

    GROUP: ClassVar[str] = "prefill"

    server: ServerSettings = server(50071)
    kvstore: str | None = setting(
        None,
        "the kvstore to push blocks to (HOST:PORT); default: the kvstore replicas registered "
        "in --redis-url, each block to its owner by rendezvous hashing",
    )
    kv_push_timeout: float = setting(
        10.0,
        "seconds a push of a prompt's blocks to a kvstore may take; a push that fails or "
        "takes longer is given up (the decode worker recomputes those blocks)",
    )
    kv_prefix_fetch_timeout: float = setting(
        2.0,
        "the shared prefix tier: seconds this worker waits for the kvstore's copy of a "
        "prompt's prefix blocks that its own prefix cache lacks (any prefill worker's, "
        "pushed there); those found are imported, not computed. A miss costs one round "
        "trip; a slow kvstore, at most this. 0: off, every prefix is computed here",
    )
    transport: KVTransportSettings = setting(default_factory=KVTransportSettings)
    registry: RegistrySettings = setting(default_factory=RegistrySettings)
    engine: EngineArgs = setting(default_factory=EngineArgs)
    watchdog: WatchdogSettings = setting(default_factory=WatchdogSettings)
    tracing: TracingSettings = setting(default_factory=TracingSettings)
    metrics: MetricsSettings = setting(default_factory=MetricsSettings)
    security: InternalSecuritySettings = setting(default_factory=InternalSecuritySettings)
    log: LogSettings = setting(default_factory=LogSettings)

    def __post_init__(self) -> None:
        check(
            self.kv_prefix_fetch_timeout >= 0,
            f"--kv-prefix-fetch-timeout must be 0 (off) or positive seconds, got "
            f"{self.kv_prefix_fetch_timeout}",
        )
        check(
            self.kv_push_timeout > 0,
            f"--kv-push-timeout must be positive seconds, got {self.kv_push_timeout}",
        )
        check(
            bool(self.kvstore or self.registry.redis.redis_url),
            "a prefill worker needs a kvstore: pass --kvstore HOST:PORT, or --redis-url to use "
            "the kvstore replicas registered there",
        )
        if self.kvstore:
            check_address(self.kvstore, "--kvstore")


@dataclass(frozen=True)
class DecodeSettings:
    """A decode worker (it also prefills prompts sent without a first token)."""

    GROUP: ClassVar[str] = "decode"

    server: ServerSettings = server(50081)
    kvstore: tuple[str, ...] = setting(
        (),
        "a kvstore this worker may fetch blocks from (repeatable; the variable is "
        "comma-separated), beside the replicas registered in --redis-url; a request that "
        "names any other kvstore is refused",
        metavar="HOST:PORT",
    )
    kv_fetch_timeout: float = setting(
        10.0,
        "seconds a fetch of a request's blocks from a kvstore may take; a fetch that fails or "
        "takes longer costs only recomputing those blocks",
    )
    transport: KVTransportSettings = setting(default_factory=KVTransportSettings)
    registry: RegistrySettings = setting(default_factory=RegistrySettings)
    engine: EngineArgs = setting(default_factory=EngineArgs)
    watchdog: WatchdogSettings = setting(default_factory=WatchdogSettings)
    tracing: TracingSettings = setting(default_factory=TracingSettings)
    metrics: MetricsSettings = setting(default_factory=MetricsSettings)
    security: InternalSecuritySettings = setting(default_factory=InternalSecuritySettings)
    log: LogSettings = setting(default_factory=LogSettings)

    def __post_init__(self) -> None:
        check(
            self.kv_fetch_timeout > 0,
            f"--kv-fetch-timeout must be positive seconds, got {self.kv_fetch_timeout}",
        )
        for address in self.kvstore:
            check_address(address, "--kvstore")


@dataclass(frozen=True)
class KVStoreSettings:
    """A kvstore replica."""

    GROUP: ClassVar[str] = "kvstore"

    server: ServerSettings = server(50061, drain_timeout=5.0)
    capacity_bytes: str = setting(
        "2GiB", "memory for blocks, e.g. 512MiB or 2GiB; least recently used out first"
    )
    block_layout: str | None = setting(
        None,
        "the only block layout this kvstore stores, written as its log prints the layout of "
        "a first put: every field as NAME=VALUE (version=...,model_fingerprint=HEX,"
        "dtype=...,...); default: the first put's",
    )
    block_lease: float = setting(
        60.0,
        "seconds a put block waits for its first get before it expires (the decode worker it "
        "was pushed for never asked); a fetched block stays until LRU evicts it; 0: no lease",
    )
    disk_path: str | None = setting(
        None,
        "a directory for a disk tier: blocks LRU evicts from memory, and those memory holds "
        "at a clean stop, are written there (one checksummed file each) and served from "
        "there when a get misses memory; a kvstore started again on it serves them again (it keeps one block layout: another "
        "--block-layout is refused); default: no disk tier",
    )
    disk_capacity_bytes: str = setting(
        "8GiB",
        "disk for the --disk-path tier's files, e.g. 8GiB; least recently used out first",
    )
    registry: RegistrySettings = setting(default_factory=RegistrySettings)
    tracing: TracingSettings = setting(default_factory=TracingSettings)
    metrics: MetricsSettings = setting(default_factory=MetricsSettings)
    security: InternalSecuritySettings = setting(default_factory=InternalSecuritySettings)
    log: LogSettings = setting(default_factory=LogSettings)

    def __post_init__(self) -> None:
        size = size_setting("--capacity-bytes", self.capacity_bytes)
        check(size >= 1, f"--capacity-bytes must be positive, got {self.capacity_bytes}")
        check(
            self.block_lease >= 0,
            f"--block-lease must be 0 (no lease) or positive seconds, got {self.block_lease}",
        )
        disk = size_setting("--disk-capacity-bytes", self.disk_capacity_bytes)
        check(
            disk >= 1,
            f"--disk-capacity-bytes must be positive, got {self.disk_capacity_bytes}",
        )
        check(
            not (self.disk_path and os.path.isfile(self.disk_path)),
            f"--disk-path must be a directory (or where to make one), not the file {self.disk_path}",
        )

    @property
    def capacity(self) -> int:
        """``--capacity-bytes`` in bytes."""
        return parse_size(self.capacity_bytes)

    @property
    def disk_capacity(self) -> int:
        """``--disk-capacity-bytes`` in bytes."""
        return parse_size(self.disk_capacity_bytes)


@dataclass(frozen=True)
class RoutingSettings:
    """How a gateway picks workers."""

    GROUP: ClassVar[str] = "routing"

    routing: str = setting(
        "prefix",
        "prefix: the worker with the lowest prefix_weight*uncached_blocks + "
        "load_weight*load_blocks; round-robin: in turn",
        choices=("prefix", "round-robin"),
    )
    route_prefix_weight: float = setting(1.0, "cost of a prompt block the worker lacks")
    route_load_weight: float = setting(0.5, "cost of a KV block in use on the worker")
    local_prefill_threshold: int = setting(
        0,
        "conditional disaggregation: a prompt whose uncached part on the chosen decode worker "
        "is shorter than this many tokens is prefilled there; 0: always use the prefill pool",
    )

    def __post_init__(self) -> None:
        check(
            self.route_prefix_weight >= 0 and self.route_load_weight >= 0,
            "--route-prefix-weight and --route-load-weight must be 0 or more",
        )
        check(
            self.local_prefill_threshold >= 0,
            f"--local-prefill-threshold must be 0 or more, got {self.local_prefill_threshold}",
        )


# vLLM's --tool-call-parser names that the gateway parses (pdserve.gateway.tool_parsers).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


@dataclass(frozen=True)
class OpenAISettings:
    """What the OpenAI REST API accepts beyond the defaults (vLLM's flags of the same names)."""

    GROUP: ClassVar[str] = "openai api"

    enable_auto_tool_choice: bool = setting(
        False,
        "tool_choice auto (the default when a request sends tools): the output is parsed for "
        "tool calls with --tool-call-parser; off: such requests are refused (400). "
        "tool_choice required or a named function needs neither: a grammar makes the calls",
    )
    tool_call_parser: str | None = setting(
        None, "how tool calls are written in the model's output", choices=TOOL_CALL_PARSERS
    )
    chat_template: str | None = setting(
        None,
        "a chat template (a file, or the Jinja text itself) used instead of the model's own, "
        "e.g. one that renders tools for a model whose template ignores them",
    )
    allow_unknown_fields: bool = setting(
        False,
        "accept request fields that neither OpenAI nor vLLM define (logged and ignored); off: "
        "400 naming them",
    )
    return_tokens_as_token_ids: bool = setting(
        False, 'logprobs name each token "token_id:N" (a request may ask for it too)'
    )
    enable_prompt_tokens_details: bool = setting(
        False, "usage carries prompt_tokens_details.cached_tokens (prefix-cache hits)"
    )
    enable_force_include_usage: bool = setting(
        False, "every stream carries usage in each chunk, whatever stream_options says"
    )
    enable_tokenizer_info_endpoint: bool = setting(
        False, "serve GET /tokenizer_info (the tokenizer's configuration and chat template)"
    )
    max_prompts: int = setting(64, "most prompts one /v1/completions request may batch")
    root_path: str | None = setting(
        None,
        "a path prefix the API is also served under (e.g. /llm: /llm/v1/... beside /v1/...), "
        "for a reverse proxy that forwards it unchanged",
    )

    def __post_init__(self) -> None:
        check(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})",
        )
        check(self.max_prompts >= 1, f"--max-prompts must be at least 1, got {self.max_prompts}")
        check(
            self.root_path is None
            or (
                self.root_path.startswith("/")
                and self.root_path.rstrip("/") != ""
                and "//" not in self.root_path
                and not any(c.isspace() or c in "?#" for c in self.root_path)
            ),
            f"--root-path must be a path such as /llm (a leading /, no spaces, ? or #), got "
            f"{self.root_path!r}",
        )


@dataclass(frozen=True)
class GatewaySettings:
    """Where the gateway listens, which workers it sends to, and its limits."""

    GROUP: ClassVar[str] = "gateway"

    server: ServerSettings = server(50051, drain_timeout=10.0)
    http_port: int = setting(
        8000, "port of the OpenAI REST API on the same host; 0: any free port, -1: off"
    )
    served_model_name: str | None = setting(
        None, "the model name the REST API serves and expects (default: the model dir's name)"
    )
    metrics_port: int = setting(
        -1,
        "a plain HTTP port of its own for GET /metrics and GET /health, e.g. for a scraper "
        "admitted by a NetworkPolicy; with it the public REST port no longer serves /metrics "
        "(its series name the workers' addresses); -1: /metrics on the REST port, as vLLM",
    )
    ssl_certfile: str | None = setting(
        None,
        "PEM certificate chain the public fronts present: the REST API serves HTTPS and the "
        "gRPC front TLS (vLLM's flag); followed as it rotates. Unset: both plaintext. The "
        "internal --tls-cert is never shown to clients",
    )
    ssl_keyfile: str | None = setting(None, "PEM private key (unencrypted) of --ssl-certfile")
    prefill_addrs: tuple[str, ...] = setting(
        (),
        "a prefill worker (repeatable; the variable is comma-separated)",
        flag="--prefill",
        metavar="HOST:PORT",
    )
    decode_addrs: tuple[str, ...] = setting(
        (),
        "a decode worker (repeatable; the variable is comma-separated)",
        flag="--decode",
        metavar="HOST:PORT",
    )
    disaggregation: bool = setting(
        True, "on: prefill on prefill workers, KV through the kvstore; off: decode workers do both"
    )
    model: str | None = setting(None, "checkpoint dir (default: the prepared SmolLM2)")
    max_model_len: int | None = setting(
        None, "longest prompt + output in tokens (default: the model's limit)"
    )
    max_tokens_default: int | None = setting(
        None,
        "the most tokens a request that leaves max_tokens unset generates; unset: as vLLM, "
        "chat and gRPC requests the rest of the context, completions 16 (OpenAI's default)",
    )
    prefill_timeout: float = setting(60.0, "seconds a Prefill call may take")
    decode_timeout: float = setting(600.0, "seconds a Decode stream may take")
    migration_limit: int = setting(
        3,
        "times a request's decode stream may move to another decode worker when its own "
        "breaks (dies, fails, or sends nothing for --stream-idle-timeout); 0: never",
    )
    stream_idle_timeout: float = setting(
        30.0, "seconds a decode stream may send nothing before it counts as broken"
    )
    migration_wait: float = setting(
        60.0,
        "seconds a broken stream waits for a decode worker to move to when no other is "
        "left (e.g. while a supervisor restarts the only one)",
    )
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on the REST /v1 routes and the gRPC front (default: open)",
        secret=True,
    )
    max_body_bytes: int = setting(
        4 << 20,
        "largest request: a REST body (413 past it) or a gRPC message (RESOURCE_EXHAUSTED)",
    )
    max_concurrent_requests: int = setting(
        256, "requests (REST and gRPC together) generating at once; more wait in the queue"
    )
    max_queued_requests: int = setting(
        512,
        "requests waiting for a slot; past that, 429 with Retry-After (gRPC: "
        "RESOURCE_EXHAUSTED with retry-after metadata)",
    )
    queue_timeout: float = setting(30.0, "seconds a queued request waits before it is refused")
    send_timeout: float = setting(
        30.0,
        "seconds a streaming client may go without reading before its stream is cancelled "
        "and its slot freed",
    )
    max_n: int = setting(16, "most choices (n) one REST request may ask for")
    max_stop: int = setting(16, "most stop strings, and most stop token ids, of one request")
    max_stop_chars: int = setting(1024, "longest stop string, in characters")
    max_logprobs: int = setting(
        MAX_LOGPROBS, f"most top logprobs per token a request may ask for (0 to {MAX_LOGPROBS})"
    )
    openai: OpenAISettings = setting(default_factory=OpenAISettings)
    routing: RoutingSettings = setting(default_factory=RoutingSettings)
    redis: RedisSettings = setting(default_factory=RedisSettings)
    tracing: TracingSettings = setting(default_factory=TracingSettings)
    security: InternalSecuritySettings = setting(default_factory=InternalSecuritySettings)
    log: LogSettings = setting(default_factory=LogSettings)

    def __post_init__(self) -> None:
        if self.redis.redis_url:
            check(
                not self.decode_addrs and not self.prefill_addrs,
                "pass either --redis-url (the pools come from the registry) or --prefill/"
                "--decode addresses, not both",
            )
        else:
            check(
                bool(self.decode_addrs),
                "no decode worker: pass --decode HOST:PORT (repeat it for several workers), "
                "or --redis-url to find the workers registered there",
            )
            check(
                not self.disaggregation or bool(self.prefill_addrs),
                "--disaggregation on needs a prefill worker: pass --prefill HOST:PORT, or use "
                "--disaggregation off to let decode workers prefill prompts themselves",
            )
        for address in (*self.prefill_addrs, *self.decode_addrs):
            check_address(address, "a worker address")
        check(
            -1 <= self.http_port <= 65535,
            f"--http-port must be in [0, 65535], or -1 to turn the REST API off; got "
            f"{self.http_port}",
        )
        check(
            self.served_model_name is None or bool(self.served_model_name.strip()),
            "--served-model-name must not be empty",
        )
        check(
            -1 <= self.metrics_port <= 65535,
            f"--metrics-port must be in [0, 65535], or -1 for /metrics on the REST port; got "
            f"{self.metrics_port}",
        )
        check(
            bool(self.ssl_certfile) == bool(self.ssl_keyfile),
            "--ssl-certfile and --ssl-keyfile go together: pass both, or neither for plaintext "
            "public fronts",
        )
        check(
            self.max_model_len is None or self.max_model_len >= 2,
            f"--max-model-len must be at least 2, got {self.max_model_len}",
        )
        check(
            self.max_tokens_default is None or self.max_tokens_default >= 1,
            f"--max-tokens-default must be at least 1, got {self.max_tokens_default}",
        )
        check(
            self.api_key is None or bool(self.api_key.strip()),
            "--api-key must not be empty (leave it unset for an open REST API)",
        )
        check(
            self.max_body_bytes >= 1024,
            f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}",
        )
        check(
            self.max_concurrent_requests >= 1,
            f"--max-concurrent-requests must be at least 1, got {self.max_concurrent_requests}",
        )
        check(
            self.migration_limit >= 0,
            f"--migration-limit must be 0 or more, got {self.migration_limit}",
        )
        check(1 <= self.max_n <= MAX_N, f"--max-n must be in [1, {MAX_N}], got {self.max_n}")
        for flag, value in (
            ("--max-stop", self.max_stop),
            ("--max-stop-chars", self.max_stop_chars),
        ):
            check(value >= 1, f"{flag} must be at least 1, got {value}")
        check(
            0 <= self.max_logprobs <= MAX_LOGPROBS,
            f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}",
        )
        check(
            self.max_queued_requests >= 0,
            f"--max-queued-requests must be 0 or more, got {self.max_queued_requests}",
        )
        for flag, value in (
            ("--queue-timeout", self.queue_timeout),
            ("--send-timeout", self.send_timeout),
            ("--prefill-timeout", self.prefill_timeout),
            ("--decode-timeout", self.decode_timeout),
            ("--stream-idle-timeout", self.stream_idle_timeout),
            ("--migration-wait", self.migration_wait),
        ):
            check(value > 0, f"{flag} must be a positive number of seconds, got {value}")
