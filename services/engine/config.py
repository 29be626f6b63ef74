"""What the engine adds to the torch-free settings: torch devices and dtypes.

``EngineArgs`` and ``ModelConfig`` are in ``services.common`` (the launcher and the gateway
read them without torch); this module turns their names into torch objects.
"""

from __future__ import annotations

import torch

from services.common.config import EngineArgs
from services.common.model import ModelConfig

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


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is the checkpoint's dtype on CUDA and float32 on the CPU.

    CPUs without AMX run bf16/fp16 matmuls slower than fp32 (measured: 150 vs 260
    GFLOP/s on the reference machine), and float32 is the dtype of the exactness contract.
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch_dtype(checkpoint_dtype)
