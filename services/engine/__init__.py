"""The model engine shared by prefill and decode workers.

Names are imported on first use, so that light modules of this package (the block
pool, the KV-transfer layout) can be used without loading torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "services.engine.llm",
    "RequestOutput": "services.engine.llm",
    "EngineArgs": "services.engine.config",
    "EngineStats": "services.engine.engine",
    "LLMEngine": "services.engine.engine",
    "SamplingParams": "services.engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'services.engine' has no attribute {name!r}")
