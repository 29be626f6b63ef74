"""What the engine adds to the torch-free settings: torch devices and dtypes.

``EngineArgs`` and ``ModelConfig`` are in ``pdserve.common`` (the launcher and the gateway
read them without torch); this module turns their names into torch objects.
"""

from __future__ import annotations

import torch

from pdserve.core.model import ModelConfig
from pdserve.settings.engine import EngineArgs

__all__ = ["EngineArgs", "ModelConfig", "resolve_device", "resolve_dtype", "torch_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name ("bfloat16"); float32 for a name torch lacks here."""
    return _DTYPES.get(name, torch.float32)


def resolve_device(args: EngineArgs) -> torch.device:
    """``--device``: auto is cuda when available, else cpu."""
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def resolve_dtype(args: EngineArgs, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``--dtype``: ``auto`` is the checkpoint's dtype on CUDA, and on the CPU the faster of
    float32 and bfloat16 as measured on this machine (``dtype_probe``; float32 remains the
    exactness mode, chosen explicitly)."""
    if args.dtype != "auto":
        return _DTYPES[args.dtype]
    if device.type == "cpu":
        from pdserve.engine.dtype_probe import cpu_dtype

        return _DTYPES[cpu_dtype(args, cfg)]
    return torch_dtype(cfg.checkpoint_dtype)
