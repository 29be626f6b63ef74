"""An AsyncEngine given a builder loads its engine on the engine thread, which is then the
process's only user of torch's threads: the thread that started it runs its own torch ops
serially (one OpenMP pool in the process, whose threads spin between a step's parallel
regions instead of sleeping). A failed build raises in the caller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, json, os, sys, threading
import torch
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.settings.engine import EngineArgs
from pdserve.core.sampling import SamplingParams

torch.set_num_threads(2)
path = sys.argv[1]
built_on = []

def make():
    built_on.append(threading.current_thread().name)
    return LLMEngine(EngineArgs(model=path, dtype="float32", num_kv_blocks=64), path)

def refused():
    raise ValueError("no such model")

try:
    AsyncEngine(refused)
    error = None
except ValueError as e:
    error = str(e)
engine = AsyncEngine(make)
x = torch.randn(512, 512)
(x @ x).add_(1).sum()  # the caller's own op, after the engine started

async def run():
    threads = await engine.call(lambda e: torch.get_num_threads())
    tokens = []
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    async for delta in engine.generate("r", list(range(5, 30)), params):
        tokens.extend(delta.token_ids)
    return threads, tokens

threads, tokens = asyncio.run(run())
engine.shutdown()
print(json.dumps({"built_on": built_on, "error": error, "caller": torch.get_num_threads(),
                  "engine": threads, "tokens": len(tokens)}))
"""


def test_the_engine_thread_builds_the_engine_and_owns_the_torch_threads(tiny_llama_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] == "no such model"
    assert result["built_on"] == ["engine"]
    assert result["caller"] == 1
    assert result["engine"] == 2
    assert result["tokens"] == 8
