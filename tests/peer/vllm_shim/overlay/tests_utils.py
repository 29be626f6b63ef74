"""vLLM's tests/utils.py for the pdserve peer run: its ``RemoteOpenAIServer`` starts a
pdserve cluster (pdserve_peer_shim.server); the GPU markers skip; any other name is a
placeholder of the vllm stub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pdserve_peer_shim import vllm_stub
from pdserve_peer_shim.server import RemoteOpenAIServer, get_open_port

__all__ = ["VLLM_PATH", "ROCM_EXTRA_ARGS", "RemoteOpenAIServer", "get_open_port"]

VLLM_PATH = Path(__file__).parent.parent
"""Path to root of the vLLM source release (tests/ and examples/)."""

ROCM_EXTRA_ARGS: list[str] = []
ROCM_ENGINE_KWARGS: dict = {}

RemoteVLLMServer = RemoteOpenAIServer
RemoteOpenAIServerCustom = RemoteOpenAIServer

requires_fp8 = pytest.mark.skipif(True, reason="FP8 needs a GPU (not in the pdserve peer run)")


def _gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(True, reason=f"needs {n} GPUs (not in the pdserve peer run)")


def multi_gpu_only(*, num_gpus: int = 2):
    return _gpus(num_gpus)


def multi_gpu_test(*, num_gpus: int):
    return _gpus(num_gpus)


def multi_gpu_marks(*, num_gpus: int):
    return [_gpus(num_gpus)]


def large_gpu_mark(min_gb: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(True, reason=f"needs a GPU with {min_gb} GB")


def large_gpu_test(*, min_gb: int):
    return large_gpu_mark(min_gb)


def single_gpu_only(f=None):
    return f if f is not None else (lambda g: g)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return vllm_stub.placeholder(f"tests.utils.{name}")
