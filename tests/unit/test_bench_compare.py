"""bench/serving/compare.py's command lines, medians and RESULTS.md section (no servers started)."""

from __future__ import annotations

from pathlib import Path

from bench.serving import compare


def _metrics(tok_s: float, tpot: float) -> dict:
    return {
        "output_throughput": tok_s,
        "tpot_ms": {"p50": tpot},
        "ttft_ms": {"p50": 400.0},
        "itl_ms": {"p99": 90.0},
        "failed": 0,
    }


def _sweep(*points: tuple[float, float]) -> dict:
    return {
        "concurrencies": [1, 4, 16][: len(points)],
        "runs": [{"metrics": _metrics(*p)} for p in points],
    }


def test_default_sweep_sends_every_prompt_at_every_concurrency():
    args = compare.parse_args([])
    argv = compare.sweep_argv(args, "http://127.0.0.1:1", Path("/m/Model"), "x", Path("o.json"))
    assert "--prompts-per-concurrency" not in argv
    assert argv[argv.index("--num-prompts") + 1] == "64"
    assert argv[argv.index("--concurrencies") + 1] == "1,4,16"

    args = compare.parse_args(["--prompts-per-concurrency", "8"])
    argv = compare.sweep_argv(args, "http://127.0.0.1:1", Path("/m/Model"), "x", Path("o.json"))
    assert argv[argv.index("--prompts-per-concurrency") + 1] == "8"


def test_median_over_repeats_per_concurrency():
    runs = compare.median_runs(
        [_sweep((10, 80), (30, 120)), _sweep((12, 70), (36, 100)), _sweep((11, 90), (33, 110))]
    )
    assert runs["1"]["output tok/s"] == 11
    assert runs["1"]["TPOT p50 ms"] == 80
    assert runs["4"]["output tok/s"] == 33
    assert runs["4"]["TPOT p50 ms"] == 110
    assert compare.median_runs([]) == {}


def _summary(per_c: int | None) -> dict:
    args = vars(
        compare.parse_args([] if per_c is None else ["--prompts-per-concurrency", str(per_c)])
    )
    ok = {"system": "hf", "runs": compare.median_runs([_sweep((18.8, 50.5))]), "commands": ["srv"]}
    failed = {"system": "vllm", "runs": {}, "commands": ["vllm serve"], "error": "StartFailed: x"}
    return {
        "date": "2026-11-29",
        "machine": "cpu, 2 cores",
        "model": "M",
        "args": args,
        "command": "--repeats 2",
        "systems": [ok, failed],
    }


def test_section_states_the_workload_and_shows_failures():
    text = compare.markdown(_summary(None))
    assert "the same 64 prompts (seed 0) at every concurrency" in text
    assert "| hf | 1 | 18.8 | 50.5 | 400 | 90 | 0 |" in text
    assert "| vllm | - | failed: see below |" in text
    assert "Failed: `StartFailed: x`" in text

    text = compare.markdown(_summary(8))
    assert "at concurrency c the first min(64, 8·c) prompts" in text
