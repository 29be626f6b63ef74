"""`pdserve bench` against a real colocated cluster (gateway + decode worker, tiny Llama):
every workload, a sweep, the plots, and a server that refuses every request."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.loadgen.cli import main as bench_main
from tests.helpers.clusters import rest_address, running, start_colocated

MODEL_NAME = "tiny"
OUTPUT_LEN = 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def chat_model(tiny_chat_llama_path):
    return tiny_chat_llama_path


@pytest.fixture(scope="module")
def base_url(chat_model, tmp_path_factory):
    with running(tmp_path_factory.mktemp("bench-logs")) as c:
        start_colocated(c, chat_model, gateway=["--served-model-name", MODEL_NAME])
        yield f"http://{rest_address(c)}"
        assert not c.unhandled_errors()


def bench(base_url, chat_model, tmp_path, *flags, command="serve", model=MODEL_NAME):
    """Run `pdserve bench <command>` with the common flags; returns (exit code, result JSON)."""
    result_file = tmp_path / f"{command}.json"
    argv = [
        command,
        *("--base-url", base_url, "--model", model, "--tokenizer", str(chat_model)),
        *("--seed", "0", "--no-progress", "--result-file", str(result_file), "--timeout", "60"),
        *flags,
    ]
    code = bench_main(argv)
    return code, json.loads(result_file.read_text())


def assert_all_succeeded(result, num_requests):
    metrics, requests = result["metrics"], result["requests"]
    assert (metrics["completed"], metrics["failed"]) == (num_requests, 0), requests
    assert len(requests) == num_requests
    for r in requests:
        assert r["success"] and r["error"] == "" and r["status"] == 200
        assert r["output_len"] == r["expected_output_len"]  # ignore_eos: exact lengths
        assert 0 < r["ttft"] <= r["e2el"]
        # A chunk per token, or fewer when some carry several tokens (split characters).
        assert 1 <= len(r["itl"]) + 1 <= r["output_len"]
    assert metrics["total_output_tokens"] == sum(r["output_len"] for r in requests)
    assert metrics["ttft_ms"]["count"] == num_requests
    assert metrics["output_throughput"] > 0


def test_random_completions(base_url, chat_model, tmp_path):
    code, result = bench(
        base_url,
        chat_model,
        tmp_path,
        *("--workload", "random", "--num-prompts", "8", "--max-concurrency", "4"),
        *("--random-input-len", "32", "--random-output-len", str(OUTPUT_LEN)),
        *("--goodput", "ttft:60000", "e2el:60000"),
        # With token ids the gateway sends every token in its own chunk, text or not.
        *("--extra-body", '{"return_token_ids": true}'),
    )
    assert code == 0
    assert_all_succeeded(result, 8)
    assert result["config"]["workload"] == "random"
    assert result["config"]["max_concurrency"] == 4
    assert result["metrics"]["request_goodput"] == pytest.approx(
        result["metrics"]["request_throughput"]
    )
    for r in result["requests"]:
        assert 30 <= r["input_len"] <= 32 and r["server_input_len"] == r["input_len"]
        assert len(r["itl"]) == OUTPUT_LEN - 1
        assert r["tpot"] == pytest.approx((r["e2el"] - r["ttft"]) / (OUTPUT_LEN - 1))


def test_shared_prefix_chat(base_url, chat_model, tmp_path):
    code, result = bench(
        base_url,
        chat_model,
        tmp_path,
        *("--workload", "shared-prefix", "--endpoint", "chat", "--num-prompts", "6"),
        *("--num-groups", "2", "--prefix-len", "48", "--suffix-len", "8"),
        *("--output-len", str(OUTPUT_LEN), "--max-concurrency", "4"),
        *("--extra-body", '{"return_token_ids": true}'),
    )
    assert code == 0
    assert_all_succeeded(result, 6)
    for r in result["requests"]:
        # A chunk per token; the chat stream's role announcement is not one.
        assert len(r["itl"]) == OUTPUT_LEN - 1
    assert result["metrics"]["total_input_tokens"] == sum(
        r["input_len"] for r in result["requests"]
    )
    assert all(r["server_input_len"] > r["input_len"] for r in result["requests"])  # template


def test_multi_turn_resends_the_history(base_url, chat_model, tmp_path):
    code, result = bench(
        base_url,
        chat_model,
        tmp_path,
        *("--workload", "multi-turn", "--endpoint", "chat", "--num-conversations", "3"),
        *("--turns", "2", "--turn-input-len", "16", "--output-len", str(OUTPUT_LEN)),
        *("--max-concurrency", "4"),
    )
    assert code == 0
    assert_all_succeeded(result, 6)
    by_turn = {(r["session"], r["turn"]): r for r in result["requests"]}
    for conversation in range(3):
        first, second = by_turn[conversation, 0], by_turn[conversation, 1]
        # The second prompt holds the first turn and its reply, then a new question.
        assert second["server_input_len"] > first["server_input_len"] + OUTPUT_LEN // 2
        assert second["start"] >= first["start"] + first["e2el"]


def test_long_short_reports_short_ttft(base_url, chat_model, tmp_path):
    code, result = bench(
        base_url,
        chat_model,
        tmp_path,
        *("--workload", "long-short", "--num-prompts", "8", "--long-fraction", "0.25"),
        *("--long-input-len", "128", "--short-input-len", "16", "--output-len", "4"),
        *("--max-concurrency", "4", "--request-rate", "50"),
    )
    assert code == 0
    assert_all_succeeded(result, 8)
    kinds = [r["kind"] for r in result["requests"]]
    assert kinds.count("long") == 2 and kinds.count("short") == 6
    by_kind = result["metrics"]["ttft_ms_by_kind"]
    assert (by_kind["long"]["count"], by_kind["short"]["count"]) == (2, 6)


def test_jsonl_prompts_and_messages(base_url, chat_model, tmp_path):
    dataset = tmp_path / "data.jsonl"
    lines = [
        {"prompt": "the quick brown fox", "output_len": 5},
        {"messages": [{"role": "user", "content": "pdserve serves tokens"}], "output_len": 3},
        {"prompt": "over the lazy dog", "output_len": 6},
    ]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code, result = bench(
        base_url,
        chat_model,
        tmp_path,
        *("--workload", "jsonl", "--dataset-path", str(dataset), "--endpoint", "chat"),
    )
    assert code == 0
    assert_all_succeeded(result, 3)
    assert [r["output_len"] for r in result["requests"]] == [5, 3, 6]


def test_itl_has_a_gap_per_streamed_chunk(base_url, chat_model, tmp_path):
    prompts = ["the quick brown fox", "pdserve serves tokens, fast", "over the lazy dog"]
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "output_len": 6}) + "\n" for p in prompts))
    code, result = bench(
        base_url, chat_model, tmp_path, "--workload", "jsonl", "--dataset-path", str(dataset)
    )
    assert code == 0
    assert_all_succeeded(result, 3)
    # The same greedy requests, streamed and counted here: the tiny model emits tokens that
    # complete no character, which the gateway sends with the next token, in one chunk.
    for prompt, r in zip(prompts, result["requests"], strict=True):
        chunks = streamed_chunks(base_url, prompt, 6)
        assert len(r["itl"]) == len(chunks) - 1
        if len(chunks) == 6:
            assert len(r["itl"]) == r["output_len"] - 1


def streamed_chunks(base_url, prompt, max_tokens):
    """The texts of a streamed completion's chunks, one per chunk with choices."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    texts = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                texts += [c["text"] for c in json.loads(line[len("data: ") :])["choices"]]
    return texts


def test_sweep_and_plot(base_url, chat_model, tmp_path, capsys):
    flags = ["--workload", "random", "--num-prompts", "4", "--random-input-len", "16"]
    flags += ["--random-output-len", "4", "--label", "pdserve"]
    code, sweep = bench(
        base_url, chat_model, tmp_path, *flags, "--concurrencies", "1,4", command="sweep"
    )
    assert code == 0
    assert sweep["kind"] == "sweep" and sweep["concurrencies"] == [1, 4]
    assert [run["config"]["max_concurrency"] for run in sweep["runs"]] == [1, 4]
    for run in sweep["runs"]:
        assert_all_succeeded(run, 4)
    # The same seed sends the same prompts at every concurrency.
    lens = [[r["input_len"] for r in run["requests"]] for run in sweep["runs"]]
    assert lens[0] == lens[1]

    code, _ = bench(base_url, chat_model, tmp_path, *flags[:-2], "--max-concurrency", "2")
    assert code == 0
    capsys.readouterr()
    out = tmp_path / "plots"
    files = [str(tmp_path / "sweep.json"), str(tmp_path / "serve.json")]
    assert bench_main(["plot", *files, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    expected = {"ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png", "e2el_cdf.png"}
    expected |= {"throughput_vs_concurrency.png", "tpot_p50_vs_concurrency.png"}
    assert {p.name for p in out.iterdir()} == expected
    assert sorted(printed) == sorted(str(out / name) for name in expected)
    for name in expected:
        assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_refused_requests_are_counted_as_failures(base_url, chat_model, tmp_path, capsys):
    code, result = bench(
        base_url,
        chat_model,
        tmp_path,
        *("--workload", "random", "--num-prompts", "3", "--random-input-len", "8"),
        *("--random-output-len", "4"),
        model="no-such-model",
    )
    assert code == 1  # nothing succeeded
    assert (result["metrics"]["completed"], result["metrics"]["failed"]) == (0, 3)
    for r in result["requests"]:
        assert not r["success"] and r["status"] == 404
        assert r["error"].startswith("HTTP 404") and "no-such-model" in r["error"]
    out = capsys.readouterr().out
    assert "Failed requests:                         3" in out
    assert "3 x HTTP 404" in out


def test_an_unreachable_server_fails_every_request(chat_model, tmp_path, capsys):
    code, result = bench(
        "http://127.0.0.1:9",  # the discard port: nothing listens
        chat_model,
        tmp_path,
        *("--workload", "random", "--num-prompts", "2", "--random-input-len", "8"),
    )
    assert code == 1
    assert result["metrics"]["failed"] == 2
    assert all(r["error"].startswith("ConnectError") for r in result["requests"])
    assert "2 x ConnectError" in capsys.readouterr().out
