"""The planner closes the loop on this machine: `pdserve profile` measures the tiny model's
workers, `pdserve up --autoscale` serves a low -> high -> low request rate, and the decode
pool grows within a stated time of the step up and shrinks after the step down, while no
request fails (those in flight when a worker drains included) and the p90 targets hold in
the steady phases.

Each decode worker runs one sequence at a time (--max-num-seqs 1), so that one worker's
capacity is a rate this machine's client and gateway reach easily: the high phase is more
than one worker can serve and less than two can."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.loadgen.client import ClientConfig, run_sessions
from pdserve.loadgen.workloads import WorkloadParams, build_workload, load_tokenizer
from pdserve.planner.model import Profile, percentile
from pdserve.planner.simulate import Cluster, Traffic, simulate
from tests.helpers.up_process import ROOT, read_until

ENGINE = ("--dtype", "float32", "--enforce-eager", "--max-num-seqs", "1", "--num-kv-blocks", "64")
PROMPT, OUTPUT = 64, 24
TTFT_MS, ITL_MS = 800.0, 60.0
SCALE_UP_WITHIN_S = 15.0  # from the step up to the new worker's start (its load: ~5 s more)
LOW_S, HIGH_S, LOW_AFTER_S = 6.0, 26.0, 18.0
# Of the high phase not counted as steady: the scale-up, the new worker's start, and the
# queue of the seconds before it; of the low phase after: the scale-in.
HIGH_SETTLE_S, LOW_SETTLE_S = 14.0, 8.0


@pytest.fixture(scope="module")
def profile_path(tiny_chat_llama_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "tiny.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "pdserve.cli", "profile", "--model", str(tiny_chat_llama_path),
            *ENGINE, "--prompt-len", "16", "--prompt-len", "64", "--prompt-len", "128",
            "--batch-size", "1", "--batch-size", "2", "--long-context", "128",
            "--repeats", "2", "--out", str(out),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decode    batch" in done.stdout
    return out


def test_profile_is_what_plan_reads(profile_path):
    profile = Profile.load(profile_path)
    assert profile.model == "tiny" and profile.dtype == "float32"
    assert profile.max_num_seqs == 1 and profile.hardware["cores_per_worker"] == 1
    assert list(profile.prefill.x) == [16.0, 64.0, 128.0]
    assert all(ms > 0 for ms in (*profile.prefill.y, *profile.decode.y))
    assert profile.measured["seconds"] > 0
    done = subprocess.run(
        [
            sys.executable, "-m", "pdserve.cli", "plan", "--profile", str(profile_path),
            "--request-rate", "2", "--prompt-len", str(PROMPT), "--output-len", str(OUTPUT),
            "--ttft-p90-ms", str(TTFT_MS), "--itl-p90-ms", str(ITL_MS), "--json",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["meets_targets"] and body["prefill_replicas"] + body["decode_replicas"] == 1


def _rates(profile: Profile) -> tuple[float, float]:
    """A low rate one decode worker serves, and a high one it cannot but two can, by the
    profile's own prediction."""
    one, two = Cluster(0, 1), Cluster(0, 2)

    def meets(cluster: Cluster, rate: float) -> bool:
        p = simulate(profile, cluster, Traffic(rate, PROMPT, OUTPUT, num_prompts=200))
        return p.ttft(90) <= TTFT_MS and p.itl(90) <= ITL_MS

    rate = 1.0
    while meets(one, rate * 1.25):
        rate *= 1.25
    high = rate * 1.5
    assert meets(two, high), f"two workers predicted short at {high:.1f} req/s"
    return rate * 0.3, high


async def _phase(base: str, tok, rate: float, seconds: float, seed: int):
    params = WorkloadParams(random_input_len=PROMPT, random_output_len=OUTPUT)
    sessions = build_workload("random", params, tok, max(int(rate * seconds), 1), seed)
    config = ClientConfig(base_url=base, model="tiny", request_rate=rate, seed=seed)
    began = time.time()
    result = await run_sessions(config, sessions)
    return began, result.records


def _log_times(text: str, pattern: str) -> list[float]:
    """Wall-clock times of the planner's log lines that match ``pattern``."""
    out = []
    for line in text.splitlines():
        if re.search(pattern, line) and (
            m := re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)", line)
        ):
            stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            out.append(stamp.timestamp())
    return out


def _steady(records, began: float, settle: float, until: float):
    ttft, itl = [], []
    for r in records:
        if began + settle <= began + r.start and began + r.start + r.e2el <= until:
            ttft.append(r.ttft * 1000)
            itl += [g * 1000 for g in r.itl]
    return ttft, itl


def test_autoscale_follows_a_load_ramp_without_failing_a_request(
    profile_path, tiny_chat_llama_path, tmp_path
):
    profile = Profile.load(profile_path)
    low, high = _rates(profile)
    log = tmp_path / "up.err"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "pdserve.cli", "up", "--disaggregation", "off",
                "--decode", "1", "--port", "0", "--http-port", "0", "--log-dir", str(tmp_path),
                "--model", str(tiny_chat_llama_path), *ENGINE, "--autoscale",
                "--profile", str(profile_path), "--interval", "1", "--window", "4",
                "--scale-down-delay", "4", "--max-decode", "2",
                "--ttft-p90-ms", str(TTFT_MS), "--itl-p90-ms", str(ITL_MS),
            ],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, bufsize=0, start_new_session=True,
            env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")},
        )  # fmt: skip
    try:
        out = read_until(proc, "Ctrl-C stops everything", timeout=90)
        base = re.search(r"REST +(http://\S+)/v1", out).group(1)
        tok = load_tokenizer(tiny_chat_llama_path)

        async def ramp():
            phases = []
            for i, (rate, seconds) in enumerate(((low, LOW_S), (high, HIGH_S), (low, LOW_AFTER_S))):
                phases.append((rate, *await _phase(base, tok, rate, seconds, seed=i)))
            return phases

        phases = asyncio.run(ramp())
        ended = time.time()
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    records = [r for _, _, recs in phases for r in recs]
    failed = [r.error for r in records if not r.success]
    assert not failed, f"{len(failed)} of {len(records)} failed: {failed[:3]}"

    (_, low_began, low_recs), (_, high_began, high_recs), (_, after_began, after_recs) = phases
    ups = _log_times(text, r"decode: up 1 -> 2")
    downs = _log_times(text, r"decode: down 2 -> 1")
    assert ups, text[-3000:]
    assert high_began <= ups[0] <= high_began + SCALE_UP_WITHIN_S, (
        ups[0] - high_began,
        text[-3000:],
    )
    assert not [t for t in ups if t < high_began], "scaled up in the low phase"
    assert downs and after_began < downs[0] < ended, text[-3000:]
    assert "draining decode-1" in out + proc.stdout.read().decode()  # up's own lines

    # Requests in flight as the scale-in began (a drain lets them finish, or hands them on).
    began = {id(r): b + r.start for _, b, recs in phases for r in recs}
    in_flight = [r for r in records if began[id(r)] <= downs[0] <= began[id(r)] + r.e2el]
    print(
        f"rates {low:.1f} -> {high:.1f} -> {low:.1f} req/s; scale-up decided "
        f"{ups[0] - high_began:.1f} s after the step; scale-in {downs[0] - after_began:.1f} s "
        f"after the step down, {len(in_flight)} request(s) in flight; {len(records)} requests"
    )

    # The targets hold at p90 in the steady phases: low before, high once the new worker
    # serves, low after the scale-in.
    steady = [
        _steady(low_recs, low_began, 0.0, high_began),
        _steady(high_recs, high_began, HIGH_SETTLE_S, after_began),
        _steady(after_recs, after_began, LOW_SETTLE_S, ended),
    ]
    for ttft, itl in steady:
        assert len(ttft) >= 3
        assert percentile(ttft, 90) <= TTFT_MS and percentile(itl, 90) <= ITL_MS, (
            percentile(ttft, 90),
            percentile(itl, 90),
        )
