"""`pdserve up` and `pdserve status` without processes: CPU placement, each pool's
tensor-parallel size, the flags children get, settings, tables."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.controlplane.registry import WorkerInfo
from pdserve.core.errors import SettingsError
from pdserve.local.launcher import cpu_slices
from pdserve.settings.commands import UpSettings
from pdserve.settings.engine import EngineArgs
from pdserve.settings.flags import parse_settings, to_argv
from pdserve.settings.process import RegistrySettings, ServerSettings
from pdserve.settings.services import DecodeSettings, PrefillSettings
from pdserve.status import format_tables, status_json


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


@pytest.mark.parametrize(
    ("layout", "cpus", "roles", "expected"),
    [
        ("decode-first", [0, 1], ["prefill", "decode"], [[1], [0, 1]]),
        (
            "decode-first",
            [0, 1, 2, 3],
            ["prefill", "prefill", "decode", "decode"],
            [[3], [2], [0, 1], [2, 3]],
        ),
        ("decode-first", [0, 1], ["prefill"] * 3 + ["decode"], [[1], [0], [1], [0, 1]]),
        ("split", [0, 1], ["prefill", "decode"], [[0], [1]]),
        ("shared", [0, 1], ["prefill", "decode"], [[0, 1], [0, 1]]),
        ("decode-first", [0, 1], ["decode"], [[0, 1]]),
    ],
)
def test_engine_cpus_by_layout(layout, cpus, roles, expected):
    from pdserve.up import engine_cpus

    assert engine_cpus(layout, cpus, roles) == expected


def test_a_worker_gets_only_the_flags_that_differ_from_the_defaults():
    engine = EngineArgs(
        model="/m", dtype="float32", num_kv_blocks=64, enable_prefix_caching=False, num_threads=3
    )
    worker = PrefillSettings(
        server=ServerSettings(port=0),
        kvstore="127.0.0.1:9",
        registry=RegistrySettings(),
        engine=engine,
    )
    argv = to_argv(worker)
    assert argv == [
        "--port", "0", "--kvstore", "127.0.0.1:9", "--model", "/m", "--dtype", "float32",
        "--num-kv-blocks", "64", "--no-enable-prefix-caching", "--num-threads", "3",
    ]  # fmt: skip
    assert parse_settings(PrefillSettings, argv, "p", "") == worker


_SETTINGS = UpSettings(num_prefill=1, port=0, http_port=0, startup_timeout=60)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_decode": 0}, "--decode must be 1 or more"),
        ({"num_prefill": 0}, "--disaggregation on needs a prefill worker"),
        ({"port": 70000}, "--port must be between"),
        ({"startup_timeout": 0}, "--startup-timeout"),
        ({"kvstore_capacity": "lots"}, "--kvstore-capacity"),
    ],
)
def test_up_settings_refuse_bad_values(change, message):
    with pytest.raises(SettingsError, match=message):
        replace(_SETTINGS, **change)


def test_up_settings_allow_no_prefill_workers_when_colocated():
    assert replace(_SETTINGS, num_prefill=None, disaggregation=False).prefill_workers == 0
    assert replace(_SETTINGS, num_prefill=None).prefill_workers == 1


def test_each_pool_takes_its_own_tensor_parallel_size_else_the_engines():
    argv = ["--tensor-parallel-size", "2", "--prefill-tensor-parallel-size", "1"]
    settings = parse_settings(UpSettings, argv, "pdserve up", "")
    assert settings.tensor_parallel_size("prefill") == 1
    assert settings.tensor_parallel_size("decode") == 2
    swapped = replace(settings, engine=EngineArgs(), prefill_tensor_parallel_size=2)
    assert [swapped.tensor_parallel_size(r) for r in ("prefill", "decode")] == [2, 1]


def test_a_workers_ranks_split_its_cores_and_reach_its_command_line():
    from pdserve.up import worker_engine

    settings = replace(_SETTINGS, decode_tensor_parallel_size=2)
    prefill = worker_engine(settings, "prefill", [3], "/m")
    decode = worker_engine(settings, "decode", [0, 1, 2], "/m")
    assert (prefill.tensor_parallel_size, prefill.num_threads) == (1, 1)
    assert (decode.tensor_parallel_size, decode.num_threads) == (2, 1)
    assert worker_engine(settings, "decode", [0], "/m").num_threads == 1  # ranks share it
    pinned = replace(settings, engine=EngineArgs(num_threads=4))
    assert worker_engine(pinned, "decode", [0, 1], "/m").num_threads == 4
    argv = to_argv(replace(_decode_worker(), engine=decode))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in to_argv(replace(_decode_worker(), engine=prefill))


def test_colocated_decode_workers_take_the_engine_flag_and_refuse_a_prefill_size():
    from pdserve.up import worker_engine

    colocated = replace(
        _SETTINGS, num_prefill=None, disaggregation=False, engine=EngineArgs(tensor_parallel_size=2)
    )
    assert worker_engine(colocated, "decode", [0, 1], "/m").tensor_parallel_size == 2
    with pytest.raises(SettingsError, match="--prefill-tensor-parallel-size needs a prefill"):
        replace(colocated, prefill_tensor_parallel_size=1)
    with pytest.raises(SettingsError, match="--decode-tensor-parallel-size must be >= 1"):
        replace(_SETTINGS, decode_tensor_parallel_size=0)


def _decode_worker() -> DecodeSettings:
    return DecodeSettings(server=ServerSettings(port=0), registry=RegistrySettings())


def _workers(now: float) -> list[WorkerInfo]:
    return [
        WorkerInfo("decode-a", "decode", "127.0.0.1:2", model="tiny", num_total_blocks=100,
                   num_free_blocks=75, num_running=2, num_waiting=1, prefix_cache_queries=40,
                   prefix_cache_hits=10, spec_num_draft_tokens=80, spec_num_accepted_tokens=60,
                   updated_at=now - 0.5),
        WorkerInfo("decode-b", "decode", "127.0.0.1:3", model="tiny", num_total_blocks=100,
                   num_free_blocks=100, tensor_parallel_size=2, updated_at=now - 0.25),
        WorkerInfo("kvstore-a", "kvstore", "127.0.0.1:4", capacity_bytes=2 << 30,
                   bytes_used=512 << 20, updated_at=now - 1.0),
    ]  # fmt: skip


def test_status_tables_show_each_pool_with_totals():
    text = format_tables(_workers(1000.0), now=1000.0)
    lines = text.splitlines()
    assert lines[0] == "prefill (0)" and "(none registered)" in lines[1]
    decode = lines[lines.index("decode (2)") + 1 : lines.index("kvstore (1)")]
    assert decode[0].split()[:4] == ["id", "address", "model", "TP"]
    assert decode[1].split() == ["decode-a", "127.0.0.1:2", "tiny", "1", "2", "1", "25/100",
                                 "(25%)", "25%", "(10/40)", "75%", "(60/80)", "0.5s"]  # fmt: skip
    assert decode[2].split()[3] == "2"  # its tensor-parallel size
    assert decode[2].split()[-2:] == ["-", "0.2s"]  # no speculation
    assert decode[3].split()[:7] == ["total", "(2)", "2", "1", "25/200", "(12%)", "25%"]
    assert "512.0 MiB / 2.0 GiB (25%)" in text


def test_status_json_counts_pools_and_ages():
    pools = status_json(_workers(1000.0), now=1000.0)["pools"]
    assert [len(pools[r]["workers"]) for r in ("prefill", "decode", "kvstore")] == [0, 2, 1]
    assert pools["decode"]["totals"]["active_blocks"] == 25
    assert pools["decode"]["totals"]["spec_num_accepted_tokens"] == 60
    assert pools["kvstore"]["workers"][0]["heartbeat_age_s"] == 1.0
    assert [w["tensor_parallel_size"] for w in pools["decode"]["workers"]] == [1, 2]
