"""`pdserve bench serve` against the plain transformers baseline (bench/serving/hf_server.py), so
that both systems are measured by the same client."""

from __future__ import annotations

import json

import pytest

from pdserve.loadgen.cli import main as bench_main
from tests.helpers.clusters import running, start_hf_server

MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def hf_server(tiny_chat_llama_path, tmp_path_factory):
    model = tiny_chat_llama_path
    with running(tmp_path_factory.mktemp("bench-baseline")) as c:
        server = start_hf_server(c, model, batch_wait_ms=20)
        yield f"http://{server.address}", model


def test_bench_serve_measures_the_baseline(hf_server, tmp_path):
    base_url, model = hf_server
    result_file = tmp_path / "hf.json"
    code = bench_main(
        [
            "serve",
            *("--base-url", base_url, "--model", MODEL_NAME, "--tokenizer", str(model)),
            *("--workload", "random", "--num-prompts", "6", "--max-concurrency", "4"),
            *("--random-input-len", "24", "--random-output-len", "6", "--seed", "0"),
            *("--label", "transformers", "--no-progress", "--timeout", "60"),
            *("--result-file", str(result_file)),
        ]
    )
    assert code == 0
    result = json.loads(result_file.read_text())
    assert (result["metrics"]["completed"], result["metrics"]["failed"]) == (6, 0)
    assert result["label"] == "transformers"
    for r in result["requests"]:
        assert r["success"] and r["output_len"] == 6 and 0 < r["ttft"] <= r["e2el"]
