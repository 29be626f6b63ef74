"""The settings of every pdserve process, one frozen dataclass each (see ``settings``).

They live together, free of torch, because they cross process boundaries: ``pdserve up``
turns them into its children's flags, a gateway reads the same ``PDSERVE_*`` variables
as the workers beside it, and one list of them (``ALL_SETTINGS``) tells a misspelled
variable from a setting of another command. Every service's settings start with its
``server`` group and end with ``log``, so every ``--help`` reads the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from services.common.redaction import redact_url
from services.common.sampling import DEFAULT_MAX_TOKENS, MAX_LOGPROBS
from services.common.settings import SettingsError, check, setting
from services.common.sizes import parse_size
from services.common.speculative import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
MAX_N = 128  # the most choices --max-n may allow


@dataclass(frozen=True)
class ServerSettings:
    """Where a service listens, and how long it drains on SIGTERM."""

    GROUP: ClassVar[str] = "server"

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "port to listen on; 0 picks a free one (printed in the READY line)")
    drain_timeout: float = setting(30.0, "seconds running requests get to finish on SIGTERM")

    def __post_init__(self) -> None:
        check(bool(self.host), "--host must not be empty")
        check(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        check(self.drain_timeout > 0, f"--drain-timeout must be positive, got {self.drain_timeout}")


def server(port: int, drain_timeout: float = 30.0) -> ServerSettings:
    """A service's default server group (each service has its own default port)."""
    return setting(default_factory=lambda: ServerSettings(port=port, drain_timeout=drain_timeout))


@dataclass(frozen=True)
class LogSettings:
    """How a process logs."""

    GROUP: ClassVar[str] = "logging"

    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: str = setting(
        "text", "text, or json: one JSON object per line", choices=("text", "json")
    )

    def __post_init__(self) -> None:
        levels = ("DEBUG", "INFO", "WARNING", "ERROR")
        check(
            self.log_level.upper() in levels,
            f"--log-level must be one of {', '.join(levels)}, got {self.log_level!r}",
        )


@dataclass(frozen=True)
class RedisSettings:
    """The Redis that holds the registry of a cluster."""

    GROUP: ClassVar[str] = "control plane"

    redis_url: str | None = setting(
        None,
        "the cluster's Redis (e.g. redis://127.0.0.1:6379/0): workers and kvstores register "
        "there and gateways find them there; unset: no registry",
        secret=True,  # it may hold a password: `pdserve up` passes it by environment
    )
    redis_prefix: str = setting(
        "pdserve", "key prefix of the registry: clusters sharing one Redis use different ones"
    )

    def __post_init__(self) -> None:
        check(bool(self.redis_prefix), "--redis-prefix must not be empty")

    def __repr__(self) -> str:  # a URL's password stays out of the settings logged at start
        url = redact_url(self.redis_url)
        return f"RedisSettings(redis_url={url!r}, redis_prefix={self.redis_prefix!r})"


@dataclass(frozen=True)
class RegistrySettings:
    """How a worker or kvstore registers itself."""

    GROUP: ClassVar[str] = "control plane"

    redis: RedisSettings = setting(default_factory=RedisSettings)
    registry_ttl: float = setting(5.0, "seconds a registry entry outlives the last heartbeat")
    advertise_address: str | None = setting(
        None,
        "HOST:PORT others should dial (default: the bound address; set it when binding "
        "0.0.0.0 or ::, e.g. to the pod IP; an IPv6 host with or without brackets)",
    )

    def __post_init__(self) -> None:
        check(self.registry_ttl > 0, f"--registry-ttl must be positive, got {self.registry_ttl}")
        if self.advertise_address is not None:
            check_address(self.advertise_address, "--advertise-address")


@dataclass(frozen=True)
class TracingSettings:
    """OpenTelemetry traces of this process, exported over OTLP/gRPC (docs/observability.md)."""

    GROUP: ClassVar[str] = "observability"

    otlp_traces_endpoint: str | None = setting(
        None,
        "OTLP/gRPC collector to send traces to (e.g. http://127.0.0.1:4317; https:// for TLS); "
        "unset: the OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT variable, "
        "and without either, tracing is off",
    )
    trace_sample_ratio: float = setting(
        1.0,
        "fraction of requests traced when tracing is on (0 to 1); a request whose caller sent "
        "a sampled traceparent is traced whatever this says",
    )

    def __post_init__(self) -> None:
        check(
            0.0 <= self.trace_sample_ratio <= 1.0,
            f"--trace-sample-ratio must be in [0, 1], got {self.trace_sample_ratio}",
        )
        check(
            self.otlp_traces_endpoint is None or bool(self.otlp_traces_endpoint.strip()),
            "--otlp-traces-endpoint must not be empty (leave it unset for no tracing)",
        )


@dataclass(frozen=True)
class MetricsSettings:
    """Where a worker or kvstore serves its Prometheus /metrics."""

    GROUP: ClassVar[str] = "observability"

    metrics_port: int = setting(
        0,
        "port of the HTTP server of /metrics (Prometheus text) on --host; 0: any free one "
        "(printed in a READY line and registered), -1: off",
    )

    def __post_init__(self) -> None:
        check(
            -1 <= self.metrics_port <= 65535,
            f"--metrics-port must be in [0, 65535], or -1 for no metrics server; got "
            f"{self.metrics_port}",
        )


MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class InternalSecuritySettings:
    """The trust between a cluster's services: a shared token, and TLS (docs/security.md)."""

    GROUP: ClassVar[str] = "internal security"

    internal_token: str | None = setting(
        None,
        "the cluster's shared secret: prefill and decode workers and kvstores refuse calls "
        "without it (UNAUTHENTICATED), and every pdserve service sends it to them; give it by "
        "the variable or --internal-token-file (a flag's value is visible to every user of "
        "the machine); unset: internal calls are not checked",
        secret=True,
    )
    internal_token_file: str | None = setting(
        None, "a file whose first line is the internal token (instead of --internal-token)"
    )
    tls_cert: str | None = setting(
        None,
        "PEM certificate chain of this service: its gRPC port serves TLS only, and it presents "
        "this certificate to services that ask for one (mutual TLS); needs --tls-key",
    )
    tls_key: str | None = setting(None, "PEM private key (unencrypted) of --tls-cert")
    tls_ca: str | None = setting(
        None,
        "PEM CA certificates that signed the services' certificates: calls to other pdserve "
        "services use TLS, verified against them; without it, a service with --tls-cert "
        "verifies against the system's CAs",
    )
    tls_client_ca: str | None = setting(
        None,
        "mutual TLS: accept only clients presenting a certificate signed by these PEM CA "
        "certificates; needs --tls-cert",
    )
    tls_server_name: str | None = setting(
        None,
        "the name the services' certificates are issued to, when it is not the host dialled "
        "(e.g. pods dialled by IP); default: each address's host",
    )

    def __post_init__(self) -> None:
        check(
            not (self.internal_token and self.internal_token_file),
            "pass the internal token once: --internal-token (PDSERVE_INTERNAL_TOKEN) or "
            "--internal-token-file, not both",
        )
        check(
            self.internal_token is None or len(self.internal_token.strip()) >= MIN_TOKEN_CHARS,
            f"--internal-token must have at least {MIN_TOKEN_CHARS} characters; make one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`",
        )
        check(
            bool(self.tls_cert) == bool(self.tls_key),
            "--tls-cert and --tls-key go together: pass both, or neither for plaintext",
        )
        check(
            not self.tls_client_ca or bool(self.tls_cert),
            "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key",
        )
        check(
            not self.tls_server_name or bool(self.tls_cert or self.tls_ca),
            "--tls-server-name applies to TLS only: pass --tls-ca (or --tls-cert) too",
        )

    @property
    def dials_tls(self) -> bool:
        """Whether calls to other services use TLS."""
        return bool(self.tls_cert or self.tls_ca)


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes an engine (each field is a flag, e.g. ``--max-num-seqs``)."""

    GROUP: ClassVar[str] = "engine"

    model: str | None = setting(
        None,
        "checkpoint directory (Hugging Face Llama/Qwen2/Mistral layout); default: the "
        "prepared SmolLM2-135M-Instruct (see `pdserve prepare-model`)",
    )
    dtype: str = setting(
        "auto",
        "weights and KV cache dtype: auto (the checkpoint's on CUDA; on the CPU the faster of "
        "float32 and bfloat16, timed once on this machine), float32 (the exactness mode), "
        "bfloat16, float16",
    )
    device: str = setting("auto", "auto (cuda if available, else cpu), cpu, or cuda[:N]")
    block_size: int = setting(16, "tokens per KV block (a power of two)")
    kv_cache_memory: str = setting("1GiB", "memory for the KV cache, e.g. 512MiB or 2GiB")
    num_kv_blocks: int | None = setting(None, "number of KV blocks (overrides --kv-cache-memory)")
    max_num_batched_tokens: int = setting(
        1024, "token budget of one step; longer prompts are prefilled in chunks"
    )
    max_num_seqs: int = setting(64, "most sequences running at once")
    max_model_len: int | None = setting(
        None, "longest prompt + output in tokens (default: the model's limit)"
    )
    enable_prefix_caching: bool = setting(
        True, "reuse KV blocks of earlier prompts with the same prefix"
    )
    attention_backend: str = setting(
        "auto",
        "auto (triton on CUDA; on the CPU the C kernels, or torch where they do not build), "
        "cpu, torch (the plain-torch reference) or triton",
    )
    enforce_eager: bool = setting(
        False,
        "run the plain PyTorch model: no CUDA graphs on CUDA, no inductor compile on the CPU",
    )
    num_threads: int | None = setting(None, "torch CPU threads (default: torch's choice)")
    seed: int = setting(0, "seed of unseeded random sampling")
    speculative_config: str | None = setting(
        None,
        "speculative decoding, a JSON object as vLLM's, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        "(fields: method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, model, "
        "disable_by_batch_size, min_acceptance_rate; docs/speculative.md); decode workers "
        "speculate, prefill workers ignore it; unset: no speculation",
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        SpeculativeConfig.parse(self.speculative_config)  # refuses a bad field by its name
        check(
            self.dtype in ("auto", *DTYPES),
            f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
        )
        check(
            self.device == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            f"--device must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            f"--block-size must be a power of two, got {self.block_size!r}",
        )
        check(
            size_setting("--kv-cache-memory", self.kv_cache_memory) > 0,
            "--kv-cache-memory must be positive",
        )
        for flag, value, least in (
            ("--num-kv-blocks", self.num_kv_blocks, 1),
            ("--max-num-batched-tokens", self.max_num_batched_tokens, 1),
            ("--max-num-seqs", self.max_num_seqs, 1),
            ("--max-model-len", self.max_model_len, 2),
            ("--num-threads", self.num_threads, 1),
        ):
            check(value is None or value >= least, f"{flag} must be >= {least}, got {value}")
        check(
            self.attention_backend in ("auto", "cpu", "torch", "triton"),
            f"--attention-backend must be auto, cpu, torch or triton, got "
            f"{self.attention_backend!r}",
        )


def size_setting(flag: str, value: str | int) -> int:
    """A size flag's value in bytes ("2GiB"); SettingsError naming the flag when unreadable."""
    try:
        return parse_size(value)
    except ValueError as error:
        raise SettingsError(f"{flag}: {error}") from None


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
    registry: RegistrySettings = setting(default_factory=RegistrySettings)
    engine: EngineArgs = setting(default_factory=EngineArgs)
    watchdog: WatchdogSettings = setting(default_factory=WatchdogSettings)
    tracing: TracingSettings = setting(default_factory=TracingSettings)
    metrics: MetricsSettings = setting(default_factory=MetricsSettings)
    security: InternalSecuritySettings = setting(default_factory=InternalSecuritySettings)
    log: LogSettings = setting(default_factory=LogSettings)

    def __post_init__(self) -> None:
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
        "a first put (version=1,model_fingerprint=HEX,dtype=...); default: the first put's",
    )
    block_lease: float = setting(
        60.0,
        "seconds a put block waits for its first get before it expires (the decode worker it "
        "was pushed for never asked); a fetched block stays until LRU evicts it; 0: no lease",
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

    @property
    def capacity(self) -> int:
        """``--capacity-bytes`` in bytes."""
        return parse_size(self.capacity_bytes)


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
    max_tokens_default: int = setting(
        DEFAULT_MAX_TOKENS, "max_tokens of a request that leaves it unset"
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
            self.max_model_len is None or self.max_model_len >= 2,
            f"--max-model-len must be at least 2, got {self.max_model_len}",
        )
        check(
            self.max_tokens_default >= 1,
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


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_address(address: str, what: str) -> None:
    """Refuse an address that is not HOST:PORT."""
    host, _, port = address.rpartition(":")
    check(
        bool(host) and port.isdigit(),
        f"{what} {address!r} is not HOST:PORT (e.g. 127.0.0.1:50061)",
    )
