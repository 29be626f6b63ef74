"""`pdserve up` as a user runs it: the whole cluster from one command, a real chat request
through it, `pdserve status`, killed children restarted, and Ctrl-C leaving no process
behind."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx

from pdserve.testing.metrics import metric
from tests.helpers.flags import engine_flags
from tests.helpers.up_process import (
    alive,
    descendants,
    read_until,
    start_up,
    status,
    stderr_of,
)

ROOT = Path(__file__).resolve().parents[2]
ENGINE = engine_flags(num_kv_blocks=64, max_model_len=256)
COMPILED = engine_flags(num_kv_blocks=64, max_model_len=256, enforce_eager=None)


def test_up_serves_a_chat_request_and_ctrl_c_stops_everything(tiny_chat_llama_path, tmp_path):
    runtime = {"XDG_RUNTIME_DIR": str(tmp_path / "run")}  # where up says where its cluster is
    proc = start_up(
        "--prefill", "1", "--decode", "1", "--port", "0", "--http-port", "0",
        "--model", str(tiny_chat_llama_path), "--log-dir", str(tmp_path), "--startup-timeout", "60",
        *COMPILED, env=runtime,  # the workers' default step, compiled
    )  # fmt: skip
    pids: set[int] = set()
    try:
        out = read_until(proc, "Ctrl-C stops everything", timeout=90)
        for name in ("redis", "kvstore", "prefill-0", "decode-0", "gateway"):
            assert f"✓ {name}" in out
        rest = re.search(r"REST +(http://\S+)", out).group(1)
        assert "curl -s " + rest + "/chat/completions" in out
        pids = descendants(proc.pid)
        assert len(pids) >= 5  # redis, kvstore, prefill, decode, gateway

        response = httpx.post(
            f"{rest}/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=60,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] > 0
        assert body["choices"][0]["finish_reason"] in ("stop", "length")

        # A worker reports its load a heartbeat (0.2 s) late: read until the request shows.
        # `pdserve status` finds the cluster without flags.
        deadline = time.monotonic() + 5
        while True:
            body = status(env=runtime)
            pools = body["pools"]
            decode = pools["decode"]["workers"]
            if (decode and decode[0]["requests_total"] >= 1) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert {role: len(p["workers"]) for role, p in pools.items()} == {
            "prefill": 1,
            "decode": 1,
            "kvstore": 1,
        }
        assert pools["decode"]["workers"][0]["requests_total"] >= 1
        assert body["cluster"]["up_pid"] == proc.pid and body["cluster"]["rest"] == rest
        for pool in pools.values():
            metrics = f"http://{pool['workers'][0]['metrics_address']}/metrics"
            assert "pdserve:" in httpx.get(metrics, timeout=10).text

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, stderr_of(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]
    assert list((tmp_path / "run").glob("pdserve/*")) == []  # its word of the cluster too


def test_up_stops_everything_when_a_worker_fails_to_start(tiny_chat_llama_path, tmp_path):
    # One KV block cannot hold a 256-token sequence: the workers refuse to start.
    proc = start_up(
        "--port", "0", "--http-port", "0", "--model", str(tiny_chat_llama_path),
        "--log-dir", str(tmp_path), *engine_flags(num_kv_blocks=1, max_model_len=256),
    )  # fmt: skip
    pids: set[int] = set()
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        pids |= descendants(proc.pid)
        time.sleep(0.2)
    try:
        stderr = proc.communicate(timeout=5)[1].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1, stderr
    assert "exited with code" in stderr and "before it was ready" in stderr
    assert "--kv-cache-memory" in stderr  # the worker's own error, from its log tail
    assert pids and not [p for p in pids if alive(p)]


def test_up_refuses_a_missing_model_before_starting_anything(tmp_path):
    log_dir = tmp_path / "logs"
    proc = start_up("--model", "/nonexistent", "--log-dir", str(log_dir))
    stderr = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 2
    assert "/nonexistent does not exist" in stderr
    assert not log_dir.exists()  # nothing was started


def _status(redis_url: str) -> dict:
    return status("--redis-url", redis_url)["pools"]


def _chat(rest: str) -> httpx.Response:
    """A chat request; the status may be an error while a child is restarting."""
    return httpx.post(
        f"{rest}/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=60,
    )


def _pid_of(up_pid: int, command: str) -> int:
    """The PID of up's child that runs ``pdserve COMMAND``."""
    for pid in descendants(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:4] == [b"-m", b"pdserve.cli", command.encode()]:
            return pid
    raise AssertionError(f"no {command} among the children of {up_pid}")


STREAM = {
    "model": "tiny",
    "prompt": [11, 57, 203, 9, 140, 33, 77, 5, 300, 41],
    "max_tokens": 200,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}


def _stream_tokens(rest: str, started: threading.Event, result: dict) -> None:
    """Stream STREAM's completion into ``result["tokens"]``; ``started`` once it has begun."""
    tokens = []
    try:
        body = {**STREAM, "stream": True}
        with httpx.stream("POST", f"{rest}/completions", json=body, timeout=180) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    assert "error" not in choice, line
                    tokens.extend(choice.get("token_ids") or [])
                    if len(tokens) >= 5:
                        started.set()
    finally:
        result["tokens"] = tokens
        started.set()


def test_up_restarts_killed_children_and_keeps_serving(tiny_chat_llama_path, tmp_path):
    # Slower steps: a stream is still running when its decode worker is killed (the plain
    # step, as ENGINE says: each worker's start, and restart, is then seconds shorter).
    slow = {"PDSERVE_TEST_FAULT": "engine-step-delay:0.02"}
    proc = start_up(
        "--prefill", "1", "--decode", "1", "--port", "0", "--http-port", "0",
        "--model", str(tiny_chat_llama_path), "--log-dir", str(tmp_path), "--startup-timeout", "60",
        *ENGINE, env=slow,
    )  # fmt: skip
    pids: set[int] = set()
    try:
        out = read_until(proc, "Ctrl-C stops everything", timeout=90)
        rest = re.search(r"REST +(http://\S+)", out).group(1)
        redis_url = re.search(r"Redis +(\S+)", out).group(1)
        before = _status(redis_url)
        (decode,) = before["decode"]["workers"]
        others = {p["workers"][0]["pid"] for role, p in before.items() if role != "decode"}
        pids = descendants(proc.pid)

        # A stream running when the only decode worker dies waits for its restart, moves
        # to it, and finishes as the unbroken stream does.
        want = httpx.post(f"{rest}/completions", json=STREAM, timeout=120).json()
        started, streamed = threading.Event(), {}
        reader = threading.Thread(target=_stream_tokens, args=(rest, started, streamed))
        reader.start()
        assert started.wait(60)
        os.kill(decode["pid"], signal.SIGKILL)
        back = read_until(proc, "  ✓ decode-0 back at", timeout=90)
        assert "restarting decode-0" in back
        reader.join(120)
        assert streamed["status"] == 200
        assert streamed["tokens"] == want["choices"][0]["token_ids"]
        gateway = rest.removesuffix("/v1")
        assert metric(gateway, "pdserve:stream_migrations_total", reason="unavailable") == 1

        # The old entry is gone at once (up removes it), the new worker registered itself.
        deadline = time.monotonic() + 30
        while True:
            workers = _status(redis_url)["decode"]["workers"]
            if [w["pid"] for w in workers] != [decode["pid"]] and len(workers) == 1:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.2)
        assert workers[0]["pid"] != decode["pid"] and workers[0]["worker_id"] != decode["worker_id"]
        after = _status(redis_url)
        assert {p["workers"][0]["pid"] for r, p in after.items() if r != "decode"} == others

        deadline = time.monotonic() + 60
        while (response := _chat(rest)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] > 0

        # A restarted gateway binds the ports up printed.
        grpc_address = re.search(r"gRPC +(\S+)", out).group(1)
        os.kill(_pid_of(proc.pid, "gateway"), signal.SIGKILL)
        read_until(proc, f"  ✓ gateway back at {grpc_address}", timeout=90)
        deadline = time.monotonic() + 60
        while (response := _chat(rest)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert response.status_code == 200, response.text
        pids |= descendants(proc.pid)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        stderr = stderr_of(proc)
        assert "decode-0 was killed by SIGKILL; restarting it in 1 s (crash 1 in a row" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]
