"""The planner's parts on a made-up profile: the simulator against what the profile says
alone and under load, the plan's search within its bounds, the gateways' metrics read into
a traffic, and the online decisions' hysteresis on a fake clock."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from pdserve.planner.model import Curve, Profile, percentile
from pdserve.planner.online import (
    Observed,
    Planner,
    PlannerMetrics,
    Window,
    bucket_percentile,
    parse_sample,
    run,
)
from pdserve.planner.plan import plan
from pdserve.planner.simulate import Cluster, Traffic, simulate
from pdserve.settings.planner import PlannerPolicy, PoolBounds, TargetSettings


def make_profile(**changes) -> Profile:
    fields = dict(
        model="m",
        dtype="bfloat16",
        hardware={"class": "avx2", "cores_per_worker": 1},
        prefill=Curve((64.0, 256.0, 1024.0), (60.0, 150.0, 520.0)),
        handover=Curve((64.0, 256.0, 1024.0), (4.0, 8.0, 20.0)),
        decode=Curve((1.0, 4.0, 16.0), (20.0, 24.0, 40.0)),
        context=56,
        attention_ms_per_token=0.002,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    fields.update(changes)
    return Profile(**fields)


def test_profile_round_trips_through_json_and_refuses_other_versions(tmp_path):
    profile = make_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert profile.name == "m-bfloat16-avx2"
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="measure again"):
        Profile.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        Profile.load(path)


def test_one_request_alone_sees_the_profile():
    p = make_profile()
    one = Traffic(0.001, 256, 8, num_prompts=1)
    disagg = simulate(p, Cluster(1, 1), one)
    # The prefill curve is a quadratic fitted to the points (the linears and attention).
    assert p.prefill_ms(256) == pytest.approx(150.0, rel=0.1)
    assert disagg.ttft_ms == [pytest.approx(p.prefill_ms(256))]
    # The second token: hand-over, then a step at batch 1; then steps.
    assert disagg.itl_ms[0] == pytest.approx(8.0 + p.step_ms(1, 257))
    assert disagg.itl_ms[1] == pytest.approx(p.step_ms(1, 258))
    assert len(disagg.itl_ms) == 7 and disagg.completed == 1
    colocated = simulate(p, Cluster(0, 1), one)
    # Prefilled in one chunk of 256 (under 512) on the decode worker: the same TTFT.
    assert colocated.ttft_ms == [pytest.approx(p.prefill_ms(256))]
    long = simulate(p, Cluster(0, 1), Traffic(0.001, 1024, 4, num_prompts=1))
    # Two chunks that add up to the prefill.
    assert long.ttft_ms == [pytest.approx(p.prefill_ms(1024))]


def test_load_queues_and_more_workers_relieve_it():
    p = make_profile()
    heavy = Traffic(12.0, 256, 64, num_prompts=300)
    one, three = simulate(p, Cluster(0, 1), heavy), simulate(p, Cluster(0, 3), heavy)
    assert one.ttft(90) > 5 * three.ttft(90)
    assert three.itl(90) < one.itl(90)
    # Prompts prefilled among decode rows lengthen those rows' gaps; a prefill pool does not.
    split = simulate(p, Cluster(1, 2), Traffic(3.0, 1024, 64, num_prompts=200))
    mixed = simulate(p, Cluster(0, 3), Traffic(3.0, 1024, 64, num_prompts=200))
    assert split.itl(90) < mixed.itl(90)
    # max_num_seqs bounds the batch: one sequence at a time serialises the requests.
    serial = simulate(
        make_profile(max_num_seqs=1), Cluster(0, 1), Traffic(20.0, 64, 16, num_prompts=50)
    )
    assert serial.ttft(90) > 1000


def test_plan_takes_the_fewest_workers_that_meet_the_targets():
    p = make_profile()
    targets = TargetSettings(ttft_p90_ms=1000, itl_p90_ms=60)
    light = plan(p, Traffic(0.5, 256, 32), targets, PoolBounds())
    assert light.meets and light.best.cluster.workers == 1
    heavy = plan(p, Traffic(8.0, 256, 64), targets, PoolBounds())
    assert heavy.meets and heavy.best.cluster.workers > 1
    smaller = [c for c in heavy.tried if c.cluster.workers < heavy.best.cluster.workers]
    assert smaller and not any(c.meets(targets) for c in smaller)
    assert heavy.best.ttft_p90() <= 1000 and heavy.best.itl_p90() <= 60
    only_split = plan(p, Traffic(8.0, 256, 64), targets, PoolBounds(), layout="on")
    assert only_split.best.cluster.prefill >= 1
    # Bounds: at most 2 workers cannot meet it; the closest of 2 is returned, flagged.
    capped = plan(p, Traffic(30.0, 256, 64), targets, PoolBounds(max_workers=2))
    assert not capped.meets and capped.best.cluster.workers == 2
    assert all(c.cluster.workers <= 2 for c in capped.tried)


def test_plan_command_prints_json_and_refuses_a_bad_profile(tmp_path):
    path = tmp_path / "p.json"
    make_profile().save(path)
    args = [sys.executable, "-m", "pdserve.cli", "plan", "--profile", str(path)]
    done = subprocess.run(
        [*args, "--request-rate", "0.5", "--prompt-len", "256", "--output-len", "32", "--json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["meets_targets"] and body["decode_replicas"] == 1
    assert set(body["predicted"]["ttft_ms"]) == {"p50", "p90", "p99"}
    text = subprocess.run([*args, "--request-rate", "0.5"], capture_output=True, text=True)
    assert "plan: 1 decode (colocated)" in text.stdout
    (tmp_path / "bad.json").write_text("[]")
    bad = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "plan", "--profile", str(tmp_path / "bad.json")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "not a JSON object" in bad.stderr


GATEWAY = """\
# HELP pdserve:request_success_total Finished requests.
pdserve:request_success_total{{finished_reason="length",model_name="m",role="gateway"}} {done}
pdserve:request_success_total{{finished_reason="stop",model_name="m",role="gateway"}} 0.0
pdserve:num_requests_running{{model_name="m",role="gateway"}} {running}
pdserve:num_requests_waiting{{model_name="m",role="gateway"}} 0.0
pdserve:request_prompt_tokens_sum{{model_name="m",role="gateway"}} {prompt}
pdserve:request_prompt_tokens_count{{model_name="m",role="gateway"}} {done}
pdserve:request_generation_tokens_sum{{model_name="m",role="gateway"}} {output}
pdserve:request_generation_tokens_count{{model_name="m",role="gateway"}} {done}
pdserve:time_to_first_token_seconds_bucket{{le="0.1",model_name="m",role="gateway"}} {fast}
pdserve:time_to_first_token_seconds_bucket{{le="1.0",model_name="m",role="gateway"}} {done}
pdserve:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m",role="gateway"}} {done}
pdserve:num_requests_running{{model_name="m",role="decode"}} 99
"""


def test_gateway_metrics_become_a_traffic():
    a = parse_sample([GATEWAY.format(done=10, running=2, prompt=2000, output=500, fast=10)], 0.0)
    b = parse_sample(
        [
            GATEWAY.format(done=30, running=4, prompt=4000, output=1100, fast=20),
            GATEWAY.format(done=5, running=0, prompt=1000, output=150, fast=5),
        ],
        10.0,
    )
    assert a.in_flight == 2 and b.gateways == 2 and b.finished == 35
    window = Window(60)
    window.add(a)
    assert window.observe() is None
    window.add(b)
    obs = window.observe()
    # (35 - 10 finished + 4 - 2 more in flight) / 10 s; 25 requests of 120 and 30 tokens.
    assert obs.request_rate == pytest.approx(2.7)
    assert obs.prompt_len == pytest.approx(120) and obs.output_len == pytest.approx(30)
    # Of the window's 25 first tokens, 15 under 0.1 s: p90 lies in (0.1, 1.0].
    assert 100 < obs.ttft_p90_ms <= 1000
    assert bucket_percentile({0.1: 5.0, 1.0: 10.0, float("inf"): 10.0}, 50) == pytest.approx(0.1)
    assert bucket_percentile({1.0: 0.0}, 90) is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def observed(rate: float) -> Observed:
    return Observed(10.0, rate, 256.0, 64.0, 0.0, None, None)


def test_decisions_scale_out_at_once_and_in_slowly_one_at_a_time():
    clock = FakeClock()
    policy = PlannerPolicy(
        profile="x",
        scale_down_delay=30.0,
        targets=TargetSettings(ttft_p90_ms=1000, itl_p90_ms=60),
        bounds=PoolBounds(max_decode=6),
    )
    planner = Planner(make_profile(), policy, disaggregation=False, clock=clock)
    assert planner.pools == ("decode",)
    (d,) = planner.decide(observed(10.0), {"decode": 1})
    assert d.direction == "up" and d.desired >= 3 and d.reason in ("ttft", "itl")
    big = d.desired
    assert "at 1 decode (colocated) predicted p90" in d.text
    (d,) = planner.decide(observed(10.0), {"decode": big})
    assert d.direction == "hold" and d.reason == "targets_met"
    # The load falls: smaller would do, but only after the delay, then one worker a time.
    (d,) = planner.decide(observed(0.5), {"decode": big})
    assert d.direction == "hold" and d.reason == "waiting"
    clock.now = 29.0
    (d,) = planner.decide(observed(0.5), {"decode": big})
    assert d.direction == "hold"
    clock.now = 31.0
    (d,) = planner.decide(observed(0.5), {"decode": big})
    assert d.direction == "down" and d.desired == big - 1 and d.reason == "headroom"
    (d,) = planner.decide(observed(0.5), {"decode": big - 1})
    assert d.direction == "hold" and d.reason == "waiting"  # the clock starts again
    # A surge meanwhile resets it.
    (d,) = planner.decide(observed(10.0), {"decode": big - 1})
    assert d.direction in ("up", "hold") and d.reason != "waiting"
    # No traffic: down to the minimum, after the delay; out of bounds: back into them.
    clock.now = 100.0
    (d,) = planner.decide(observed(0.0), {"decode": 2})
    assert d.reason == "waiting"
    clock.now = 140.0
    (d,) = planner.decide(observed(0.0), {"decode": 2})
    assert d.direction == "down" and d.reason == "idle"
    (d,) = planner.decide(observed(0.0), {"decode": 9})
    assert d.desired == 6 and d.reason == "bounds"


def test_disaggregated_decisions_cover_both_pools():
    policy = PlannerPolicy(
        profile="x",
        targets=TargetSettings(ttft_p90_ms=600, itl_p90_ms=60),
        bounds=PoolBounds(max_prefill=3, max_decode=4),
    )
    planner = Planner(make_profile(), policy, disaggregation=True, local_prefill_threshold=0)
    decisions = {d.pool: d for d in planner.decide(observed(6.0), {"prefill": 1, "decode": 1})}
    assert set(decisions) == {"prefill", "decode"}
    assert decisions["prefill"].desired >= 1
    assert decisions["decode"].desired + decisions["prefill"].desired > 2


class _LoopView:
    """Like RegistryView, readable only on its event loop: one decode worker."""

    def workers(self, role: str) -> list[str]:
        asyncio.get_running_loop()
        return ["w"] if role == "decode" else []


class _Gateway:
    """A scraper of one gateway whose counter grows by 4 requests a read."""

    def __init__(self) -> None:
        self.finished = 0

    def read(self) -> tuple[list[str], list[str]]:
        self.finished += 4
        return [f'pdserve:request_success_total{{role="gateway"}} {self.finished}\n'], []


def test_a_dry_run_reads_the_pools_from_the_registry_on_its_loop():
    policy = PlannerPolicy(profile="x", interval=0.01, window=1.0)
    planner = Planner(make_profile(), policy, disaggregation=False)
    decided = []

    async def main() -> None:
        stop = asyncio.Event()

        def on_decisions(decisions) -> None:
            decided.extend(decisions)
            stop.set()

        metrics = PlannerMetrics("m")
        await asyncio.wait_for(
            run(planner, _Gateway(), None, metrics, _LoopView(), stop, on_decisions), 10
        )

    asyncio.run(main())
    (d,) = decided
    assert (d.pool, d.current) == ("decode", 1)


def test_percentile_is_numpys_linear():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 90) == 5 and percentile([], 90) == 0.0


def test_prefill_between_the_points_follows_a_quadratic():
    """Prefill is linears plus attention, a + b L + c L^2: between measured lengths the fit
    follows it where straight lines between the points would overshoot."""
    true = lambda n: 20.0 + 1.2 * n + 0.0007 * n * n  # noqa: E731
    xs = (64.0, 256.0, 1024.0, 2048.0)
    p = make_profile(prefill=Curve(xs, tuple(true(x) for x in xs)))
    assert p.prefill_ms(512) == pytest.approx(true(512), rel=1e-6)
    assert p.prefill(512) > 1.1 * true(512)  # the straight line's error
    two = make_profile(prefill=Curve((64.0, 256.0), (60.0, 150.0)))
    assert two.prefill_ms(128) == pytest.approx(90.0)  # two points: a straight line


def test_simulated_arrivals_are_the_benchmarks_of_the_same_seed():
    """`pdserve plan --seed S` simulates the arrival times `pdserve bench serve --seed S`
    sends, whatever the lengths: a prediction and a measurement of the very same trace."""
    from pdserve.loadgen.client import arrival_times

    traffic = Traffic(2.0, 64, 2, range_ratio=0.5, num_prompts=50)
    sim = simulate(make_profile(), Cluster(1, 1), traffic, seed=3)
    assert sim.arrival_ms == pytest.approx([t * 1000 for t in arrival_times(50, 2.0, 3)])
    other = simulate(make_profile(), Cluster(1, 1), traffic, seed=4)
    assert other.arrival_ms != sim.arrival_ms
