"""Engine settings (EngineArgs, checked at the edge) and the model's own config (ModelConfig)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from services.common.block_hash import model_fingerprint
from services.common.env import env_default  # noqa: F401 (re-exported)
from services.common.sizes import parse_size

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
__all__ = ["EngineArgs", "ModelConfig", "parse_size", "resolve_dtype"]


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes an engine. Each field is a CLI flag (``--max-num-seqs``)."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: str | int = "1GiB"
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(
            self.dtype in ("auto", *_DTYPES),
            f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
        )
        need(
            self.device == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            f"--device must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        need(
            isinstance(self.block_size, int)
            and self.block_size >= 1
            and self.block_size & (self.block_size - 1) == 0,
            f"--block-size must be a power of two, got {self.block_size!r}",
        )
        try:
            kv_bytes = parse_size(self.kv_cache_memory)
        except ValueError as e:
            raise ValueError(f"--kv-cache-memory: {e}") from None
        need(kv_bytes > 0, "--kv-cache-memory must be positive")
        need(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks!r}",
        )
        need(
            self.max_num_batched_tokens >= 1,
            f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        need(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        need(
            self.max_model_len is None or self.max_model_len >= 2,
            f"--max-model-len must be >= 2, got {self.max_model_len}",
        )
        need(
            self.attention_backend in ("auto", "torch", "triton"),
            f"--attention-backend must be auto, torch or triton, got {self.attention_backend!r}",
        )
        need(
            self.num_threads is None or self.num_threads >= 1,
            f"--num-threads must be >= 1, got {self.num_threads}",
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from a Hugging Face ``config.json``."""

    path: Path
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q, k and v
    o_proj_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    checkpoint_dtype: torch.dtype
    eos_token_ids: frozenset[int]
    fingerprint: bytes

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{path}: architecture {archs} is not supported; pdserve serves "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        is_qwen2 = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            path=path,
            architecture=arch,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            o_proj_bias=not is_qwen2 and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=_sliding_window(raw),
            checkpoint_dtype=_DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32),
            eos_token_ids=_eos_ids(path, raw),
            fingerprint=model_fingerprint(path),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is the checkpoint's dtype on CUDA and float32 on the CPU.

    CPUs without AMX run bf16/fp16 matmuls slower than fp32 (measured: 150 vs 260
    GFLOP/s on the reference machine), and float32 is the dtype of the exactness contract.
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return checkpoint_dtype


def _sliding_window(raw: dict) -> int | None:
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window") is False or not isinstance(window, int):
        return None
    return window


def _eos_ids(path: Path, raw: dict) -> frozenset[int]:
    ids: set[int] = set()
    sources = [raw]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(e for e in eos if isinstance(e, int))
    return frozenset(ids)
