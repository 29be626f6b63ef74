"""The benchmark's metric arithmetic on records with known timings, its workloads and its flags."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.loadgen.cli import main as bench_main
from pdserve.loadgen.client import arrival_times
from pdserve.loadgen.metrics import RequestRecord, compute_metrics, distribution, request_tpot
from pdserve.loadgen.workloads import WorkloadParams, build_workload, load_tokenizer


def record(ttft, itl, e2el, output_len, input_len=10, success=True, kind="", error=""):
    return RequestRecord(
        session=0,
        turn=0,
        input_len=input_len,
        expected_output_len=output_len,
        kind=kind,
        output_len=output_len,
        ttft=ttft,
        itl=itl,
        e2el=e2el,
        success=success,
        error=error,
    )


# Request a: 5 tokens in 5 chunks; b: 4 tokens, the last chunk carrying 2 (one gap for it);
# c: 1 token (no TPOT); d: failed.
A = record(ttft=0.1, itl=[0.05, 0.05, 0.05, 0.05], e2el=0.3, output_len=5, input_len=10)
B = record(ttft=0.2, itl=[0.1, 0.3], e2el=0.6, output_len=4, input_len=20)
C = record(ttft=0.4, itl=[], e2el=0.4, output_len=1, input_len=30)
D = record(ttft=0.0, itl=[], e2el=1.0, output_len=0, input_len=40, success=False, error="HTTP 500")
RECORDS = [A, B, C, D]
DURATION = 2.0


def test_counts_tokens_and_throughput_of_successful_requests_only():
    m = compute_metrics(RECORDS, DURATION)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 60  # D's 40 not counted
    assert m.total_output_tokens == 10
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(35.0)
    assert m.request_goodput is None


def test_ttft_and_e2el_exclude_the_failed_request():
    m = compute_metrics(RECORDS, DURATION)
    assert m.ttft_ms.count == 3
    assert m.ttft_ms.mean == pytest.approx(700 / 3)
    assert m.ttft_ms.median == pytest.approx(200)
    assert m.e2el_ms.mean == pytest.approx(1300 / 3)
    assert m.e2el_ms.p99 == pytest.approx(np.percentile([300, 600, 400], 99))


def test_tpot_is_per_request_and_skips_one_token_requests():
    assert request_tpot(A) == pytest.approx(0.05)  # (0.3 - 0.1) / 4
    assert request_tpot(B) == pytest.approx(0.4 / 3)  # (0.6 - 0.2) / 3
    assert request_tpot(C) is None
    m = compute_metrics(RECORDS, DURATION)
    assert m.tpot_ms.count == 2
    assert m.tpot_ms.mean == pytest.approx((50 + 400 / 3) / 2)


def test_itl_pools_the_chunk_gaps():
    m = compute_metrics(RECORDS, DURATION)
    assert m.itl_ms.count == 6  # B's two-token chunk is one gap
    assert m.itl_ms.mean == pytest.approx(600 / 6)
    assert m.itl_ms.median == pytest.approx(50)
    assert m.itl_ms.p90 == pytest.approx(np.percentile([50, 50, 50, 50, 100, 300], 90))
    assert m.itl_ms.std == pytest.approx(np.std([50, 50, 50, 50, 100, 300]))


def test_percentiles_interpolate_linearly():
    d = distribution([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert (d.p50, d.p90, d.p99) == pytest.approx((50.5, 90.1, 99.01))
    assert d.median == pytest.approx(50.5)
    empty = distribution([])
    assert (empty.count, empty.mean, empty.p99) == (0, 0.0, 0.0)


@pytest.mark.parametrize(
    "slos, good",
    [
        ({"ttft": 150}, 1),  # only A
        ({"ttft": 250}, 2),  # A, B
        ({"tpot": 100}, 2),  # A (50 ms) and C (one token: TPOT 0); B is 133 ms
        ({"e2el": 400}, 2),  # A, C
        ({"ttft": 250, "tpot": 100}, 1),  # A
        ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3),  # never the failed D
    ],
)
def test_goodput_counts_requests_within_every_slo(slos, good):
    m = compute_metrics(RECORDS, DURATION, slos)
    assert m.request_goodput == pytest.approx(good / DURATION)


def test_ttft_by_kind_and_bad_inputs():
    short = record(0.1, [], 0.2, 2, kind="short")
    long = record(0.9, [], 1.0, 2, kind="long")
    m = compute_metrics([short, long], 1.0)
    assert m.ttft_ms_by_kind["short"].mean == pytest.approx(100)
    assert m.ttft_ms_by_kind["long"].mean == pytest.approx(900)
    with pytest.raises(ValueError, match="unknown SLO"):
        compute_metrics([short], 1.0, {"itl": 5})
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([short], 0.0)


def test_poisson_arrivals_are_seeded():
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    a = arrival_times(2000, 10.0, 1)
    assert a == arrival_times(2000, 10.0, 1) and a != arrival_times(2000, 10.0, 2)
    assert np.mean(np.diff(a)) == pytest.approx(0.1, rel=0.1)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return load_tokenizer(tiny_llama_path)


def prompts(sessions):
    return [
        (s.system, [(t.text, t.input_len, t.output_len, t.kind) for t in s.turns]) for s in sessions
    ]


@pytest.mark.parametrize("name", ["random", "shared-prefix", "multi-turn", "long-short"])
def test_workloads_are_deterministic(tokenizer, name):
    params = WorkloadParams(random_input_len=24, prefix_len=32, long_input_len=64)
    same = [build_workload(name, params, tokenizer, 6, seed=7) for _ in range(2)]
    other = build_workload(name, params, tokenizer, 6, seed=8)
    assert prompts(same[0]) == prompts(same[1])
    assert prompts(same[0]) != prompts(other)


def test_random_lengths_are_within_the_range(tokenizer):
    params = WorkloadParams(random_input_len=40, random_output_len=10, random_range_ratio=0.5)
    sessions = build_workload("random", params, tokenizer, 30, seed=0)
    inputs = [s.turns[0].input_len for s in sessions]
    outputs = [s.turns[0].output_len for s in sessions]
    for s in sessions:
        assert tokenizer.count(s.turns[0].text) == s.turns[0].input_len  # the recorded count
    assert all(20 - 2 <= n <= 60 + 2 for n in inputs) and len(set(inputs)) > 5
    assert all(5 <= n <= 15 for n in outputs) and len(set(outputs)) > 3


def test_random_lengths_hit_the_target_with_the_default_tokenizer(smollm2_path):
    tok = load_tokenizer(smollm2_path)
    sessions = build_workload("random", WorkloadParams(random_input_len=100), tok, 10, seed=0)
    assert all(abs(s.turns[0].input_len - 100) <= 2 for s in sessions)
    assert not any(i in tok.special_ids for s in sessions for i in tok.encode(s.turns[0].text))


def test_shared_prefix_groups_and_long_short_mix(tokenizer):
    params = WorkloadParams(num_groups=2, prefix_len=30, suffix_len=6, long_fraction=0.25)
    shared = build_workload("shared-prefix", params, tokenizer, 6, seed=0)
    assert len({s.system for s in shared}) == 2
    assert shared[0].system == shared[2].system != shared[1].system
    assert len({s.turns[0].text for s in shared}) == 6
    mixed = build_workload("long-short", params, tokenizer, 8, seed=0)
    assert sorted(s.turns[0].kind for s in mixed) == ["long"] * 2 + ["short"] * 6
    conversations = build_workload("multi-turn", WorkloadParams(turns=3), tokenizer, 1, seed=0)
    assert [len(s.turns) for s in conversations] == [3] * WorkloadParams().num_conversations


def test_jsonl_workload(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt": "the quick fox", "output_len": 4})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "output_len": 2})
    )
    sessions = build_workload("jsonl", WorkloadParams(dataset_path=str(path)), tokenizer, 1, 0)
    turns = [s.turns[0] for s in sessions]
    assert [t.output_len for t in turns] == [4, 2]
    assert turns[0].input_len == tokenizer.count("the quick fox")
    assert turns[1].messages == ({"role": "user", "content": "hi"},)
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: needs \"output_len\""):
        build_workload("jsonl", WorkloadParams(dataset_path=str(path)), tokenizer, 1, 0)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--goodput", "ttft=5"], "--goodput"),
        (["--goodput", "itl:5"], "--goodput"),
        (["--goodput", "ttft:abc"], "--goodput"),
        (["--goodput", "ttft:5", "ttft:6"], "--goodput"),
        (["--workload", "nope"], "--workload"),
        (["--workload", "jsonl"], "--dataset-path"),
        (["--workload", "jsonl", "--dataset-path", "/no/such.jsonl"], "--dataset-path"),
        (["--request-rate", "0"], "--request-rate"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio"),
        (["--tokenizer", "/no/such/dir"], "--tokenizer"),
        (["--extra-body", "[1]"], "--extra-body"),
    ],
)
def test_bad_flags_name_the_flag(flags, message, capsys):
    argv = ["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", *flags]
    with pytest.raises(SystemExit) as exit_info:
        bench_main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
