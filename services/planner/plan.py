"""`pdserve plan`: the replicas per pool that meet p90 TTFT and ITL targets for a traffic,
found by simulating candidate clusters on a profile (``pdserve.planner.simulate``).

Candidates go by the number of workers, fewest first: at each count, colocated (decode
workers alone) and disaggregated splits (and, where prompts vary in length, local-prefill
thresholds); the first count at which one meets both targets wins, and among its clusters
the one furthest under them. The online planner asks the same question every interval with
the traffic it observes, restricted to the running cluster's layout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.planner.model import Profile
from pdserve.planner.simulate import Cluster, Prediction, Traffic, simulate
from pdserve.settings.planner import PlanSettings, PoolBounds, TargetSettings

# Local-prefill thresholds tried where prompt lengths vary (0: every prompt to prefill).
THRESHOLDS = (0, 128, 512)


@dataclass
class Candidate:
    cluster: Cluster
    prediction: Prediction

    def ttft_p90(self) -> float:
        return self.prediction.ttft(90)

    def itl_p90(self) -> float:
        return self.prediction.itl(90)

    def slack(self, targets: TargetSettings) -> float:
        """The larger of the two p90s over its target: under 1 meets both."""
        return max(self.ttft_p90() / targets.ttft_p90_ms, self.itl_p90() / targets.itl_p90_ms)

    def meets(self, targets: TargetSettings) -> bool:
        return self.slack(targets) <= 1.0

    def to_json(self, targets: TargetSettings) -> dict:
        c = self.cluster
        return {
            "prefill_replicas": c.prefill,
            "decode_replicas": c.decode,
            "disaggregation": c.disaggregated,
            "local_prefill_threshold": c.local_prefill_threshold,
            "meets_targets": self.meets(targets),
            "predicted": self.prediction.summary(),
        }


@dataclass
class Plan:
    """The chosen cluster, and every one simulated on the way."""

    best: Candidate
    tried: list[Candidate]
    traffic: Traffic
    targets: TargetSettings

    @property
    def meets(self) -> bool:
        return self.best.meets(self.targets)


def clusters(
    bounds: PoolBounds, layout: str, traffic: Traffic, thresholds: Sequence[int] | None = None
) -> Iterable[list[Cluster]]:
    """Candidate clusters grouped by worker count, fewest first. ``layout``: auto, on, off."""
    if thresholds is None:
        top = traffic.prompt_len * (1 + traffic.range_ratio)
        thresholds = [t for t in THRESHOLDS if t == 0 or (traffic.range_ratio and t < top)]
    limit = bounds.max_prefill + bounds.max_decode
    if bounds.max_workers:
        limit = min(limit, bounds.max_workers)
    for total in range(1, limit + 1):
        group = []
        colocated = layout in ("auto", "off") and bounds.min_prefill == 0
        if colocated and bounds.min_decode <= total <= bounds.max_decode:
            group.append(Cluster(0, total))
        if layout in ("auto", "on"):
            for prefill in range(max(bounds.min_prefill, 1), bounds.max_prefill + 1):
                decode = total - prefill
                if bounds.min_decode <= decode <= bounds.max_decode:
                    group += [Cluster(prefill, decode, t) for t in thresholds]
        if group:
            yield group


def plan(
    profile: Profile,
    traffic: Traffic,
    targets: TargetSettings,
    bounds: PoolBounds,
    layout: str = "auto",
    thresholds: Sequence[int] | None = None,
    seed: int = 0,
    runs: int = 1,
) -> Plan:
    """The fewest workers that meet ``targets``; if none do within ``bounds``, the cluster of
    the most workers that comes closest."""
    tried: list[Candidate] = []
    for group in clusters(bounds, layout, traffic, thresholds):
        candidates = [Candidate(c, _pooled(profile, c, traffic, seed, runs)) for c in group]
        tried += candidates
        meeting = [c for c in candidates if c.meets(targets)]
        if meeting:
            return Plan(min(meeting, key=lambda c: c.slack(targets)), tried, traffic, targets)
    if not tried:
        raise ValueError("no cluster fits the pool bounds: check --min-*/--max-* and --max-workers")
    largest = max(c.cluster.workers for c in tried)
    closest = min(
        (c for c in tried if c.cluster.workers == largest), key=lambda c: c.slack(targets)
    )
    return Plan(closest, tried, traffic, targets)


def _pooled(profile: Profile, cluster: Cluster, traffic: Traffic, seed: int, runs: int):
    """``runs`` simulations of ``traffic`` (seeds from ``seed``), their requests pooled: the
    percentiles a run of that many requests has on average, not one draw's."""
    first = simulate(profile, cluster, traffic, seed)
    for k in range(1, runs):
        more = simulate(profile, cluster, traffic, seed + k)
        first.ttft_ms += more.ttft_ms
        first.itl_ms += more.itl_ms
        first.completed += more.completed
        first.arrival_ms += more.arrival_ms
    return first


def _text(result: Plan, profile: Profile) -> str:
    best, t = result.best, result.targets
    c, p = best.cluster, best.prediction
    lines = [
        f"profile  {profile.name} ({profile.hardware.get('cores_per_worker', '?')} cores a worker)",
        f"traffic  {result.traffic.describe()}",
        f"targets  p90 TTFT {t.ttft_p90_ms:g} ms, p90 ITL {t.itl_p90_ms:g} ms",
        "",
    ]
    if result.meets:
        lines.append(f"plan: {c.describe()}")
    else:
        lines.append(f"no cluster within the bounds meets the targets; the closest: {c.describe()}")
    lines += [
        f"  prefill replicas         {c.prefill}",
        f"  decode replicas          {c.decode}",
        f"  disaggregation           {'on' if c.disaggregated else 'off'}",
    ]
    if c.disaggregated:
        lines.append(f"  --local-prefill-threshold {c.local_prefill_threshold}")
    lines += [
        f"  predicted TTFT           p50 {p.ttft(50):.0f} ms, p90 {p.ttft(90):.0f} ms",
        f"  predicted ITL            p50 {p.itl(50):.1f} ms, p90 {p.itl(90):.1f} ms",
        "",
        "simulated:",
    ]
    for cand in result.tried:
        mark = "meets" if cand.meets(t) else "misses"
        lines.append(
            f"  {cand.cluster.describe():55s} p90 TTFT {cand.ttft_p90():8.0f} ms, "
            f"ITL {cand.itl_p90():7.1f} ms  {mark}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from pdserve.runtime.logs import configure_logging
    from pdserve.settings.flags import parse_settings

    settings = parse_settings(
        PlanSettings,
        argv,
        prog="pdserve plan",
        description="Size the prefill and decode pools for a traffic: simulate clusters on a "
        "profile (from `pdserve profile`, measured on the machines the workers will run on, "
        "one worker being --cores-per-worker cores) and print the fewest workers that meet "
        "the p90 TTFT and ITL targets, whether to disaggregate, the gateway's "
        "--local-prefill-threshold, and the predicted p50/p90 TTFT and ITL.",
    )
    configure_logging(settings.log)
    try:
        profile = Profile.load(settings.profile)
        tr = settings.traffic
        traffic = Traffic(
            tr.request_rate, tr.prompt_len, tr.output_len, tr.range_ratio, tr.num_prompts
        )
        result = plan(
            profile,
            traffic,
            settings.targets,
            settings.bounds,
            settings.disaggregation,
            seed=settings.seed,
            runs=settings.runs,
        )
    except ValueError as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    if settings.json_output:
        out = {
            "profile": profile.name,
            "traffic": vars(traffic),
            "targets": {
                "ttft_p90_ms": settings.targets.ttft_p90_ms,
                "itl_p90_ms": settings.targets.itl_p90_ms,
            },
            **result.best.to_json(settings.targets),
            "simulated": [c.to_json(settings.targets) for c in result.tried],
        }
        print(json.dumps(out, indent=1))
    else:
        print(_text(result, profile))
    return 0 if result.meets else 1
