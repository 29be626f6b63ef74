"""A served model as every process sees it, free of torch: where its checkpoint is, what its
``config.json`` says, how long a request may be, and which prompts it accepts.

The gateway checks prompts with the same ``check_prompt`` and limits as the engine, so a
request refused at the edge is exactly one the engine would refuse.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.core.errors import SettingsError
from pdserve.core.fingerprint import model_fingerprint

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({"default", DEFAULT_MODEL_NAME})
COMPLETE_MARKER = ".pdserve-complete"
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


def pdserve_home() -> Path:
    """The root of pdserve's local files: `$PDSERVE_HOME`, else `~/.cache/pdserve`."""
    home = os.environ.get("PDSERVE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "pdserve"


def default_model_dir(home: Path | None = None) -> Path:
    """Where the converted default model lives: `<home>/models/SmolLM2-135M-Instruct`."""
    return (home if home is not None else pdserve_home()) / "models" / DEFAULT_MODEL_NAME


def is_default_model(model: str | None) -> bool:
    """Whether ``--model`` names the bundled default model."""
    return model is None or model in DEFAULT_MODEL_ALIASES


def is_prepared(path: Path) -> bool:
    """Whether ``pdserve prepare-model`` finished writing ``path``."""
    return (path / COMPLETE_MARKER).is_file()


def locate_model(model: str | None, home: Path | None = None) -> Path:
    """The checkpoint directory of ``--model``; the default model must be prepared already.

    FileNotFoundError / ValueError say what to pass instead.
    """
    if is_default_model(model):
        path = default_model_dir(home)
        if not is_prepared(path):
            raise FileNotFoundError(
                f"the default model ({DEFAULT_MODEL_NAME}) is not prepared in {path.parent}: "
                "run `pdserve prepare-model` once, or pass --model DIR"
            )
        return path
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json, so it is not a Hugging Face checkpoint directory. "
                "Pass a directory holding config.json, *.safetensors and the tokenizer files."
            )
        return path.resolve()
    if path.exists():
        raise ValueError(
            f"{path} is a file; pass the checkpoint directory that holds config.json instead."
        )
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise FileNotFoundError(
            f"Model directory {path} does not exist. pdserve only loads local checkpoint "
            "directories: pass one that holds config.json, or leave --model unset to use the "
            f"default model ({DEFAULT_MODEL_NAME}, made by `pdserve prepare-model`)."
        )
    raise ValueError(
        f"{model!r} is not a local directory. pdserve only loads local checkpoints and never "
        f"downloads from the Hugging Face Hub: download it yourself (e.g. `hf download {model} "
        "--local-dir DIR`) and pass DIR, or run `pdserve prepare-model` and leave --model unset "
        f"to use the default model ({DEFAULT_MODEL_NAME})."
    )


@dataclass(frozen=True)
class ModelConfig:
    """What pdserve needs from a Hugging Face ``config.json``."""

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
    checkpoint_dtype: str  # "float32", "bfloat16", ...
    eos_token_ids: frozenset[int]
    fingerprint: bytes

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json`` (and ``generation_config.json`` for EOS ids)."""
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
        is_qwen2 = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            path=path,
            architecture=arch,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            o_proj_bias=not is_qwen2 and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=_sliding_window(raw),
            checkpoint_dtype=str(dtype).removeprefix("torch."),
            eos_token_ids=_eos_ids(path, raw),
            fingerprint=model_fingerprint(path),
        )

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of KV cache one token takes, all layers, at ``itemsize`` bytes a value."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def max_model_len(self, requested: int | None) -> int:
        """``--max-model-len``, or the model's own limit when unset; more than it supports is
        refused (SettingsError)."""
        limit = self.max_position_embeddings
        if self.sliding_window:
            limit = min(limit, self.sliding_window)
        if requested is None:
            return limit
        if requested > limit:
            raise SettingsError(
                f"--max-model-len {requested} exceeds what the model supports ({limit})"
            )
        return requested


def check_prompt(token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """Refuse (ValueError) an empty prompt, ids outside the vocabulary, or one that leaves no
    room to generate."""
    if len(token_ids) == 0:
        raise ValueError("the prompt is empty: send at least one token")
    bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise ValueError(
            f"prompt token id {bad} is out of vocabulary: prompt token ids must be "
            f"integers in [0, {vocab_size})"
        )
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, but --max-model-len is {max_model_len}: "
            "shorten it to leave room for output"
        )


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
