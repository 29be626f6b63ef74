"""`pdserve up` with a different tensor-parallel size per pool, both ways (prefill TP 1 ->
decode TP 2, prefill TP 2 -> decode TP 1): the tiny Qwen3's greedy float32 output through
the REST API is transformers' ``generate``, every prompt block is imported (none
recomputed), a TP-2 decode worker's ranks each import half of every block (their KV heads,
counted by each rank), and Ctrl-C leaves no process behind."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from pdserve.testing.metrics import metric
from pdserve.testing.reference import compare, hf_greedy, random_prompts
from pdserve.testing.tiny_models import build_tiny_checkpoint
from tests.helpers.flags import engine_flags
from tests.helpers.up_process import alive, descendants, read_until, start_up, status

MAX_NEW = 24


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))
    return path, hf_greedy(path, random_prompts(8, [17, 40, 70]), MAX_NEW)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1)], ids=["1to2", "2to1"])
def test_up_with_a_tp_size_per_pool_is_exact(qwen3, tmp_path, prefill_tp, decode_tp):
    path, refs = qwen3
    runtime = {"XDG_RUNTIME_DIR": str(tmp_path / "run")}
    proc = start_up(
        "--prefill", "1", "--decode", "1", "--port", "0", "--http-port", "0",
        "--model", str(path), "--log-dir", str(tmp_path), "--startup-timeout", "90",
        "--prefill-tensor-parallel-size", str(prefill_tp),
        "--decode-tensor-parallel-size", str(decode_tp),
        "--local-prefill-threshold", "0",
        *engine_flags(num_kv_blocks=64, max_model_len=256), env=runtime,
    )  # fmt: skip
    pids: set[int] = set()
    try:
        out = read_until(proc, "Ctrl-C stops everything", timeout=120)
        rest = re.search(r"REST +(http://\S+)", out).group(1)
        pids = descendants(proc.pid)
        with httpx.Client(base_url=rest, timeout=60) as http:
            model = http.get("/models").json()["data"][0]["id"]
            for ref in refs:
                body = {
                    "model": model,
                    "prompt": ref.prompt,
                    "max_tokens": MAX_NEW,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                response = http.post("/completions", json=body)
                assert response.status_code == 200, response.text
                compare(response.json()["choices"][0]["token_ids"], ref)
        # Followers: one per extra rank of each pool, children of their worker.
        assert len(descendants(proc.pid)) >= 5 + (prefill_tp - 1) + (decode_tp - 1)
        decode = _worker(tmp_path, "decode")
        assert decode["tensor_parallel_size"] == decode_tp
        assert _worker(tmp_path, "prefill")["tensor_parallel_size"] == prefill_tp
        decode_metrics = f"http://{decode['metrics_address']}"
        blocks = sum(-(-len(r.prompt) // 16) for r in refs)
        assert metric(decode_metrics, "pdserve:kv_blocks_imported_total") == blocks
        total = metric(decode_metrics, "pdserve:kv_bytes_imported_total")
        if decode_tp == 2:
            for rank in ("0", "1"):
                series = "pdserve:kv_rank_bytes_imported_total"
                assert metric(decode_metrics, series, rank=rank) == total / 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]


def _worker(tmp_path, role: str) -> dict:
    """The pool's one worker as `pdserve status --json` shows it."""
    (worker,) = status(env={"XDG_RUNTIME_DIR": str(tmp_path / "run")})["pools"][role]["workers"]
    return worker
