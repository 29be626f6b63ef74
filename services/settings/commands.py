"""The settings of pdserve's commands that are not services (up, generate, chat, status,
prepare-model), and ``ALL_SETTINGS``: every class whose ``PDSERVE_*`` variables exist."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.settings.engine import EngineArgs
from pdserve.settings.flags import check, env_names, setting
from pdserve.settings.planner import PlannerPolicy, PlannerSettings, PlanSettings, ProfileSettings
from pdserve.settings.process import (
    InternalSecuritySettings,
    LogSettings,
    RedisSettings,
    TracingSettings,
)
from pdserve.settings.services import (
    DecodeSettings,
    GatewaySettings,
    KVStoreSettings,
    KVTransportSettings,
    OpenAISettings,
    PrefillSettings,
    WatchdogSettings,
)
from pdserve.settings.sizes import size_setting
from pdserve.settings.variables import VARIABLES


@dataclass(frozen=True)
class UpSettings:
    """What `pdserve up` starts, and how."""

    GROUP: ClassVar[str] = "cluster"

    num_prefill: int | None = setting(
        None, "prefill workers (default: 1, or 0 with --disaggregation off)", flag="--prefill"
    )
    num_decode: int = setting(1, "decode workers", flag="--decode")
    disaggregation: bool = setting(
        True,
        "on: prefill workers prefill and hand the KV cache to decode workers through the "
        "kvstore; off: decode workers do both (no prefill workers, no kvstore)",
    )
    port: int = setting(50051, "the gateway's gRPC port; 0: any free port")
    http_port: int = setting(8000, "the OpenAI REST port; 0: any free one, -1: off")
    ssl_certfile: str | None = setting(
        None, "PEM certificate chain of the gateway's REST (HTTPS) and gRPC fronts (TLS)"
    )
    ssl_keyfile: str | None = setting(None, "PEM private key (unencrypted) of --ssl-certfile")
    redis: RedisSettings = setting(default_factory=RedisSettings)
    redis_port: int = setting(0, "port of the Redis started here (without --redis-url); 0: any")
    kvstore_capacity: str = setting("2GiB", "memory of the kvstore for KV blocks")
    local_prefill_threshold: int = setting(
        0, "prompts with fewer uncached tokens than this are prefilled on the decode worker"
    )
    cpu_layout: str = setting(
        "decode-first",
        "how the workers share this machine's cores: decode-first (the decode workers split "
        "all the cores among them, and each prefill worker also takes one of those cores, "
        "the last first), split (each worker its own cores) or shared (every worker all the "
        "cores); workers that share cores keep their idle OpenMP threads from spinning",
        choices=("split", "shared", "decode-first"),
    )
    prefill_tensor_parallel_size: int | None = setting(
        None,
        "tensor-parallel size of each prefill worker (default: --tensor-parallel-size); its "
        "ranks share the worker's cores (the --cpu-layout slice), each taking an equal part "
        "of them as its threads unless --num-threads says",
        metavar="N",
    )
    decode_tensor_parallel_size: int | None = setting(
        None,
        "tensor-parallel size of each decode worker, colocated ones included (default: "
        "--tensor-parallel-size); its ranks share the worker's cores as the prefill ones do",
        metavar="N",
    )
    autoscale: bool = setting(
        False,
        "let the planner size the pools (--prefill and --decode are the first sizes): every "
        "--interval it reads the gateway's metrics, predicts with --profile, and starts or "
        "drains workers, each on the profile's cores per worker",
    )
    planner: PlannerPolicy = setting(default_factory=PlannerPolicy)  # with --autoscale
    log_dir: str | None = setting(None, "where the services' logs go (default: a new temp dir)")
    startup_timeout: float = setting(300.0, "seconds every service gets to become ready")
    transport: KVTransportSettings = setting(default_factory=KVTransportSettings)  # workers'
    engine: EngineArgs = setting(default_factory=EngineArgs)
    openai: OpenAISettings = setting(default_factory=OpenAISettings)  # the gateway's
    watchdog: WatchdogSettings = setting(default_factory=WatchdogSettings)
    tracing: TracingSettings = setting(default_factory=TracingSettings)  # every child's
    # The token defaults to a random one per cluster here (pdserve.up).
    security: InternalSecuritySettings = setting(default_factory=InternalSecuritySettings)
    log: LogSettings = setting(default_factory=LogSettings)

    def __post_init__(self) -> None:
        check(self.num_decode >= 1, f"--decode must be 1 or more, got {self.num_decode}")
        check(self.prefill_workers >= 0, f"--prefill must be 0 or more, got {self.num_prefill}")
        check(
            self.prefill_workers >= 1 or not self.disaggregation,
            "--disaggregation on needs a prefill worker: pass --prefill 1 or more, or "
            "--disaggregation off",
        )
        for flag, port in (("--port", self.port), ("--redis-port", self.redis_port)):
            check(0 <= port <= 65535, f"{flag} must be between 0 and 65535, got {port}")
        check(-1 <= self.http_port <= 65535, f"--http-port must be -1 to 65535: {self.http_port}")
        check(
            bool(self.ssl_certfile) == bool(self.ssl_keyfile),
            "--ssl-certfile and --ssl-keyfile go together: pass both, or neither",
        )
        check(self.startup_timeout > 0, "--startup-timeout must be a positive number of seconds")
        size_setting("--kvstore-capacity", self.kvstore_capacity)
        for flag, size in (
            ("--prefill-tensor-parallel-size", self.prefill_tensor_parallel_size),
            ("--decode-tensor-parallel-size", self.decode_tensor_parallel_size),
        ):
            check(size is None or size >= 1, f"{flag} must be >= 1, got {size}")
        check(
            not self.autoscale or bool(self.planner.profile),
            "--autoscale needs --profile: a file from `pdserve profile`",
        )
        check(
            not self.autoscale or self.http_port >= 0,
            "--autoscale reads the gateway's metrics on its REST port: leave --http-port on",
        )
        check(
            self.prefill_tensor_parallel_size is None or self.prefill_workers > 0,
            "--prefill-tensor-parallel-size needs a prefill worker: leave it unset with "
            "--disaggregation off or --prefill 0",
        )

    @property
    def prefill_workers(self) -> int:
        """How many prefill workers to start."""
        if self.num_prefill is not None:
            return self.num_prefill
        return 1 if self.disaggregation else 0

    def tensor_parallel_size(self, role: str) -> int:
        """The tensor-parallel size of a ``role`` ("prefill" or "decode") worker: its pool's
        override, else the engine's."""
        size = {
            "prefill": self.prefill_tensor_parallel_size,
            "decode": self.decode_tensor_parallel_size,
        }[role]
        return self.engine.tensor_parallel_size if size is None else size


@dataclass(frozen=True)
class SamplingFlags:
    """Sampling of the one-shot commands (generate, chat)."""

    GROUP: ClassVar[str] = "sampling"

    max_tokens: int = setting(256, "most tokens to generate")
    temperature: float = setting(0.0, "0 is greedy")
    top_p: float = setting(1.0, "nucleus sampling: the smallest set of tokens covering top_p")
    top_k: int = setting(-1, "sample among the k most likely tokens; -1: all")
    sampling_seed: int | None = setting(None, "seed of the request's sampling")


def quiet_log() -> LogSettings:
    """Commands that print their own output log warnings only, unless told otherwise."""
    return LogSettings(log_level="WARNING")


@dataclass(frozen=True)
class GenerateSettings:
    """`pdserve generate`: prompts from the command line, completions to stdout."""

    GROUP: ClassVar[str] = "generate"

    chat: bool = setting(False, "wrap each prompt as a user message in the chat template")
    sampling: SamplingFlags = setting(default_factory=SamplingFlags)
    engine: EngineArgs = setting(default_factory=EngineArgs)
    log: LogSettings = setting(default_factory=quiet_log)


@dataclass(frozen=True)
class ChatSettings:
    """`pdserve chat`: a conversation in the terminal."""

    GROUP: ClassVar[str] = "chat"

    system: str | None = setting(None, "system prompt")
    sampling: SamplingFlags = setting(default_factory=SamplingFlags)
    engine: EngineArgs = setting(default_factory=EngineArgs)
    log: LogSettings = setting(default_factory=quiet_log)


@dataclass(frozen=True)
class StatusTokenSettings:
    """The cluster's internal token, which `pdserve status` verifies the entries with."""

    GROUP: ClassVar[str] = "internal security"

    internal_token: str | None = setting(
        None,
        "the cluster's internal token (as its services take it): entries it did not sign "
        "(unsigned, forged, replayed) are listed apart as refused, as gateways refuse them; "
        "unset: every entry is listed, unverified",
        secret=True,
    )
    internal_token_file: str | None = setting(
        None, "a file whose first line is the internal token (instead of --internal-token)"
    )


@dataclass(frozen=True)
class StatusSettings:
    """`pdserve status`: the registry of a cluster, read once."""

    GROUP: ClassVar[str] = "status"

    json_output: bool = setting(False, "print JSON instead of tables", flag="--json")
    redis: RedisSettings = setting(default_factory=RedisSettings)
    # The cluster's token, as its services take it: entries it does not verify (unsigned,
    # forged, replayed) are listed apart as refused, as gateways refuse them.
    security: StatusTokenSettings = setting(default_factory=StatusTokenSettings)
    log: LogSettings = setting(default_factory=quiet_log)


@dataclass(frozen=True)
class PrepareModelSettings:
    """`pdserve prepare-model`: the bundled GGUF to a safetensors checkpoint, once; or a
    local checkpoint of any served architecture, checked and copied."""

    GROUP: ClassVar[str] = "prepare-model"

    home: str | None = setting(None, "pdserve's cache directory (default: ~/.cache/pdserve)")
    model: str | None = setting(
        None,
        "a local Hugging Face checkpoint directory to check and convert (safetensors or "
        "pytorch_model*.bin); unset: the bundled default model",
    )
    output: str | None = setting(
        None, "where --model's copy goes (default: <home>/models/<the directory's name>)"
    )
    force: bool = setting(False, "convert again even if already prepared")
    quiet: bool = setting(False, "no progress display")
    log: LogSettings = setting(default_factory=quiet_log)


ALL_SETTINGS = (
    GatewaySettings,
    PrefillSettings,
    DecodeSettings,
    KVStoreSettings,
    UpSettings,
    GenerateSettings,
    ChatSettings,
    StatusSettings,
    PrepareModelSettings,
    ProfileSettings,
    PlanSettings,
    PlannerSettings,
)


def known_env() -> set[str]:
    """Every ``PDSERVE_*`` variable some pdserve command reads: the flags' and ``VARIABLES``."""
    return env_names(ALL_SETTINGS) | set(VARIABLES)
