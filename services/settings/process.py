"""What every pdserve service process shares: where it listens, how it logs, its Redis
and registry, traces, metrics and internal trust (one frozen settings group each)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.settings.flags import check, setting
from pdserve.settings.redaction import redact_url
from pdserve.settings.redis_url import is_sentinel, parse_sentinel_url


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
        "the cluster's Redis (e.g. redis://127.0.0.1:6379/0; rediss:// for TLS; through "
        "Sentinel: redis+sentinel://[:PASSWORD@]HOST:26379[,HOST:26379...]/SERVICE[/DB]): "
        "workers and kvstores register there and gateways find them there; unset: no "
        "registry",
        secret=True,  # it may hold a password: `pdserve up` passes it by environment
    )
    redis_prefix: str = setting(
        "pdserve", "key prefix of the registry: clusters sharing one Redis use different ones"
    )

    def __post_init__(self) -> None:
        check(bool(self.redis_prefix), "--redis-prefix must not be empty")
        if is_sentinel(self.redis_url):
            try:
                parse_sentinel_url(self.redis_url)
            except ValueError as error:
                check(False, f"--redis-url: {error}")

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
        None,
        "a file whose first line is the internal token (instead of --internal-token); read "
        "again when it changes (a rotated Kubernetes Secret), see --internal-token-overlap",
    )
    internal_token_overlap: float = setting(
        300.0,
        "seconds a rotated --internal-token-file's previous token is still accepted; it is "
        "still sent for the first half, so every service must see the new file within "
        "that half of each other",
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
            self.internal_token_overlap >= 0,
            f"--internal-token-overlap must be 0 or more seconds, got "
            f"{self.internal_token_overlap}",
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
