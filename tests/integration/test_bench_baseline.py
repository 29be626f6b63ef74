"""`pdserve bench serve` against the plain transformers baseline (bench/hf_server.py), so
that both systems are measured by the same client."""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cli import main as bench_main
from tests.cluster import ROOT

MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def hf_server(tiny_llama_path, tmp_path_factory):
    model = tmp_path_factory.mktemp("bench-baseline") / MODEL_NAME
    shutil.copytree(tiny_llama_path, model)
    log = model.parent / "hf_server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.hf_server", "--model", str(model), "--port", "0"]
            + ["--num-threads", "1", "--max-batch-size", "4", "--batch-wait-ms", "20"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    try:
        yield f"http://{_wait_ready(proc, log, timeout=60)}", model
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """The address of the server's `READY hf-server HOST:PORT` line (tests.cluster's
    Cluster reads only one-word service names)."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"hf_server exited with {proc.returncode}:\n{log.read_text()}")
        if sel.select(timeout=0.5):
            m = re.match(r"^READY hf-server (\S+)$", proc.stdout.readline().strip())
            if m:
                return m.group(1)
    raise TimeoutError(f"hf_server not ready after {timeout:.0f}s:\n{log.read_text()}")


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
