"""The settings of pool sizing: `pdserve profile` (measure a worker), `pdserve plan` (size
the pools for a traffic and a latency target) and `pdserve planner` (size them online)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.settings.engine import EngineArgs
from pdserve.settings.flags import check, setting
from pdserve.settings.process import InternalSecuritySettings, LogSettings, RedisSettings

ACTUATORS = ("kubernetes", "log")


def _quiet() -> LogSettings:
    return LogSettings(log_level="WARNING")


@dataclass(frozen=True)
class TargetSettings:
    """The latency targets pools are sized for."""

    GROUP: ClassVar[str] = "targets"

    ttft_p90_ms: float = setting(2000.0, "target p90 time to first token, ms")
    itl_p90_ms: float = setting(200.0, "target p90 inter-token latency, ms")

    def __post_init__(self) -> None:
        check(self.ttft_p90_ms > 0, f"--ttft-p90-ms must be positive, got {self.ttft_p90_ms}")
        check(self.itl_p90_ms > 0, f"--itl-p90-ms must be positive, got {self.itl_p90_ms}")


@dataclass(frozen=True)
class PoolBounds:
    """The replicas each pool may have."""

    GROUP: ClassVar[str] = "pool bounds"

    min_prefill: int = setting(0, "fewest prefill workers (0: decode workers may prefill all)")
    max_prefill: int = setting(4, "most prefill workers")
    min_decode: int = setting(1, "fewest decode workers")
    max_decode: int = setting(8, "most decode workers")
    max_workers: int = setting(
        0,
        "most workers of both pools together (e.g. the machines or GPUs there are); 0: no "
        "limit but the pools' own",
    )

    def __post_init__(self) -> None:
        check(0 <= self.min_prefill <= self.max_prefill, "need 0 <= --min-prefill <= --max-prefill")
        check(1 <= self.min_decode <= self.max_decode, "need 1 <= --min-decode <= --max-decode")
        check(self.max_workers >= 0, f"--max-workers must be 0 or more, got {self.max_workers}")


@dataclass(frozen=True)
class ProfileSettings:
    """`pdserve profile`: measure one prefill and one decode worker of a model, as served."""

    GROUP: ClassVar[str] = "profile"

    output: str | None = setting(
        None,
        "where the profile's JSON goes (default: profile-<model>-<dtype>-<hardware>.json here)",
        flag="--out",
    )
    cores_per_worker: int = setting(
        1, "cores each measured worker is pinned to: the size of one worker in the plan"
    )
    prompt_lens: tuple[str, ...] = setting(
        ("64", "256", "512", "1024", "2048"),
        "prompt lengths whose prefill is measured (repeatable; the variable is comma-separated)",
        flag="--prompt-len",
        metavar="TOKENS",
    )
    batch_sizes: tuple[str, ...] = setting(
        ("1", "2", "4", "8", "16", "32"),
        "decode batch sizes whose step is measured (repeatable)",
        flag="--batch-size",
        metavar="N",
    )
    long_context: int = setting(
        1024, "the context of the decode steps that measure attention's cost per token"
    )
    repeats: int = setting(3, "measurements of each point (their median is kept)")
    startup_timeout: float = setting(300.0, "seconds the measured workers get to start")
    engine: EngineArgs = setting(default_factory=EngineArgs)
    log: LogSettings = setting(default_factory=_quiet)

    def __post_init__(self) -> None:
        check(self.cores_per_worker >= 1, "--cores-per-worker must be 1 or more")
        check(self.repeats >= 1, "--repeats must be 1 or more")
        for flag, values in (
            ("--prompt-len", self.prompt_lens),
            ("--batch-size", self.batch_sizes),
        ):
            check(
                all(v.isdigit() and int(v) > 0 for v in values) and len(values) >= 2,
                f"{flag}: two or more positive integers, got {', '.join(values) or 'none'}",
            )
        check(self.long_context > 0, "--long-context must be positive")


@dataclass(frozen=True)
class TrafficSettings:
    """The traffic to size for."""

    GROUP: ClassVar[str] = "traffic"

    request_rate: float = setting(1.0, "requests per second, Poisson arrivals")
    prompt_len: int = setting(256, "mean prompt tokens")
    output_len: int = setting(128, "mean output tokens")
    range_ratio: float = setting(
        0.0, "lengths uniform in [len*(1-r), len*(1+r)], as `pdserve bench serve`'s random"
    )
    num_prompts: int = setting(
        400, "requests simulated (as --num-prompts of `pdserve bench serve`)"
    )

    def __post_init__(self) -> None:
        check(self.request_rate > 0, "--request-rate must be positive")
        check(self.prompt_len >= 1 and self.output_len >= 1, "lengths must be 1 or more")
        check(0 <= self.range_ratio < 1, "--range-ratio must be in [0, 1)")
        check(self.num_prompts >= 1, "--num-prompts must be 1 or more")


@dataclass(frozen=True)
class PlanSettings:
    """`pdserve plan`: the replicas per pool for a traffic and latency targets."""

    GROUP: ClassVar[str] = "plan"

    profile: str = setting("", "a profile's JSON, from `pdserve profile`", metavar="FILE")
    json_output: bool = setting(False, "print JSON instead of text", flag="--json")
    disaggregation: str = setting(
        "auto",
        "auto: whichever meets the targets with fewer workers; on: prefill and decode pools; "
        "off: decode workers alone",
        choices=("auto", "on", "off"),
    )
    seed: int = setting(0, "seed of the simulated arrivals and lengths")
    runs: int = setting(
        5, "simulations of each cluster (seeds from --seed), pooled: a run's average p90"
    )
    traffic: TrafficSettings = setting(default_factory=TrafficSettings)
    targets: TargetSettings = setting(default_factory=TargetSettings)
    bounds: PoolBounds = setting(default_factory=PoolBounds)
    log: LogSettings = setting(default_factory=_quiet)

    def __post_init__(self) -> None:
        check(bool(self.profile), "--profile is required: a file from `pdserve profile`")
        check(self.runs >= 1, f"--runs must be 1 or more, got {self.runs}")


@dataclass(frozen=True)
class PlannerPolicy:
    """How the planner decides: the profile it predicts with, the targets, the pools' bounds
    and how fast it moves."""

    GROUP: ClassVar[str] = "planner"

    profile: str | None = setting(None, "a profile's JSON, from `pdserve profile`", metavar="FILE")
    interval: float = setting(30.0, "seconds between decisions")
    window: float = setting(120.0, "seconds of gateway metrics each decision reads")
    scale_down_delay: float = setting(
        300.0,
        "seconds a smaller pool must have sufficed, decision after decision, before a worker "
        "is removed (scale-up is at once)",
    )
    headroom: float = setting(
        0.2, "scale in only while the smaller pool would meet the targets at (1+this) x the rate"
    )
    targets: TargetSettings = setting(default_factory=TargetSettings)
    bounds: PoolBounds = setting(default_factory=PoolBounds)

    def __post_init__(self) -> None:
        check(self.interval > 0 and self.window > 0, "--interval and --window must be positive")
        check(self.scale_down_delay >= 0, "--scale-down-delay must be 0 or more")
        check(self.headroom >= 0, "--headroom must be 0 or more")


@dataclass(frozen=True)
class PlannerSettings:
    """`pdserve planner`: sizes the pools of a running cluster every --interval."""

    GROUP: ClassVar[str] = "planner"

    gateway_metrics: tuple[str, ...] = setting(
        (),
        "a gateway's Prometheus URL, e.g. http://gw:9400/metrics (repeatable; a host name "
        "with several addresses, as a headless Service has, is scraped at each)",
        metavar="URL",
    )
    disaggregation: bool = setting(True, "whether the cluster has a prefill pool (as its gateways)")
    local_prefill_threshold: int = setting(0, "the gateways' --local-prefill-threshold")
    dry_run: bool = setting(False, "log decisions and export metrics, scale nothing")
    actuator: str = setting(
        "kubernetes",
        "kubernetes: patch the scale of --prefill-deployment and --decode-deployment (only "
        "those); log: log decisions only (as --dry-run)",
        choices=ACTUATORS,
    )
    kubernetes_api: str | None = setting(
        None, "the API server's URL (default: in-cluster, from KUBERNETES_SERVICE_HOST)"
    )
    namespace: str | None = setting(
        None, "the Deployments' namespace (default: the pod's, from its service account)"
    )
    prefill_deployment: str | None = setting(None, "the prefill pool's Deployment")
    decode_deployment: str | None = setting(None, "the decode pool's Deployment")
    metrics_port: int = setting(9400, "port of its own /metrics and /health; -1: off")
    host: str = setting("0.0.0.0", "address of its /metrics server")
    policy: PlannerPolicy = setting(default_factory=PlannerPolicy)
    redis: RedisSettings = setting(default_factory=RedisSettings)
    security: InternalSecuritySettings = setting(default_factory=InternalSecuritySettings)
    log: LogSettings = setting(default_factory=LogSettings)

    def __post_init__(self) -> None:
        check(bool(self.policy.profile), "--profile is required: a file from `pdserve profile`")
        check(bool(self.gateway_metrics), "--gateway-metrics is required (one or more URLs)")
        check(bool(self.redis.redis_url), "--redis-url is required: the cluster's registry")
        check(-1 <= self.metrics_port <= 65535, "--metrics-port must be -1 to 65535")
        if self.actuator == "kubernetes" and not self.dry_run:
            check(
                bool(self.decode_deployment)
                and (bool(self.prefill_deployment) or not self.disaggregation),
                "--actuator kubernetes needs --decode-deployment (and --prefill-deployment "
                "with --disaggregation on)",
            )
