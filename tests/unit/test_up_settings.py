"""`pdserve up` and `pdserve status` without processes: CPU placement, flags, settings,
tables; and READY-line reading against a trivial child."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from services.common.registry import WorkerInfo
from services.engine.config import EngineArgs
from services.status import format_tables, status_json
from services.supervisor import cpu_slices, read_ready_line
from services.up import UpSettings, _engine_flags


@pytest.mark.parametrize(
    ("cpus", "n", "expected"),
    [
        ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
        ([4, 5, 6, 7, 8, 9, 10], 3, [[4, 5, 6], [7, 8], [9, 10]]),
        ([0, 1], 2, [[0], [1]]),
        ([0, 1], 5, [[0], [1], [0], [1], [0]]),
        ([0, 1], 0, []),
    ],
)
def test_cpu_slices_are_contiguous_and_even(cpus, n, expected):
    assert cpu_slices(cpus, n) == expected


def test_engine_flags_repeat_only_what_differs_from_the_defaults():
    args = EngineArgs(
        model="/m", dtype="float32", num_kv_blocks=64, enable_prefix_caching=False, num_threads=3
    )
    assert _engine_flags(args) == [
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--no-enable-prefix-caching",
    ]
    assert _engine_flags(EngineArgs()) == []


_SETTINGS = UpSettings(
    num_prefill=1,
    num_decode=1,
    disaggregation=True,
    port=0,
    http_port=0,
    redis_url=None,
    redis_port=0,
    redis_prefix="pdserve",
    kvstore_capacity="2GiB",
    local_prefill_threshold=0,
    log_dir=None,
    startup_timeout_s=60,
    model="/m",
    max_model_len=None,
    num_threads=None,
    engine_flags=(),
)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_decode": 0}, "--decode must be 1 or more"),
        ({"num_prefill": 0}, "--disaggregation on needs a prefill worker"),
        ({"port": 70000}, "--port must be between"),
        ({"startup_timeout_s": 0}, "--startup-timeout"),
    ],
)
def test_up_settings_refuse_bad_values(change, message):
    with pytest.raises(ValueError, match=message):
        replace(_SETTINGS, **change)


def test_up_settings_allow_no_prefill_workers_when_colocated():
    replace(_SETTINGS, num_prefill=0, disaggregation=False)


def _workers(now: float) -> list[WorkerInfo]:
    return [
        WorkerInfo("decode-a", "decode", "127.0.0.1:2", model="tiny", num_total_blocks=100,
                   num_free_blocks=75, num_running=2, num_waiting=1, prefix_cache_queries=40,
                   prefix_cache_hits=10, updated_at=now - 0.5),
        WorkerInfo("decode-b", "decode", "127.0.0.1:3", model="tiny", num_total_blocks=100,
                   num_free_blocks=100, updated_at=now - 0.25),
        WorkerInfo("kvstore-a", "kvstore", "127.0.0.1:4", capacity_bytes=2 << 30,
                   bytes_used=512 << 20, updated_at=now - 1.0),
    ]  # fmt: skip


def test_status_tables_show_each_pool_with_totals():
    text = format_tables(_workers(1000.0), now=1000.0)
    lines = text.splitlines()
    assert lines[0] == "prefill (0)" and "(none registered)" in lines[1]
    decode = lines[lines.index("decode (2)") + 1 : lines.index("kvstore (1)")]
    assert decode[1].split() == ["decode-a", "127.0.0.1:2", "tiny", "2", "1", "25/100", "(25%)",
                                 "25%", "(10/40)", "0.5s"]  # fmt: skip
    assert decode[3].split()[:7] == ["total", "(2)", "2", "1", "25/200", "(12%)", "25%"]
    assert "512.0 MiB / 2.0 GiB (25%)" in text


def test_status_json_counts_pools_and_ages():
    pools = status_json(_workers(1000.0), now=1000.0)["pools"]
    assert [len(pools[r]["workers"]) for r in ("prefill", "decode", "kvstore")] == [0, 2, 1]
    assert pools["decode"]["totals"]["active_blocks"] == 25
    assert pools["kvstore"]["workers"][0]["heartbeat_age_s"] == 1.0


def test_read_ready_line_skips_other_output_and_reports_an_early_exit():
    script = "print('hello'); print('READY kvstore 127.0.0.1:5', flush=True)"
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE) as p:
        assert read_ready_line(p, "kvstore", timeout=30) == "127.0.0.1:5"
    with (
        subprocess.Popen(
            [sys.executable, "-c", "raise SystemExit(3)"], stdout=subprocess.PIPE
        ) as p,
        pytest.raises(RuntimeError, match="exited with code 3 before it was ready"),
    ):
        read_ready_line(p, "kvstore", timeout=30)
