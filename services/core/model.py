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
# Hugging Face architecture -> the family whose rules read its config.json.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model; the vision tower is not served
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


# Gemma3TextConfig's defaults in transformers, for the keys a checkpoint's config.json may
# leave out (Gemma 3's multimodal checkpoints give only what differs).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
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
    checkpoint_dtype: str  # "float32", "bfloat16", ...
    eos_token_ids: frozenset[int]
    fingerprint: bytes
    family: str = "llama"
    # Per layer: its attention window (0: the whole context), as transformers' layer_types.
    layer_windows: tuple[int, ...] = ()
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # of the gated MLP: "silu" or "gelu_pytorch_tanh"
    # Gemma 3: norms of (1 + w), sandwich norms around attention and MLP, a scaled embedding,
    # its own attention scale, and soft-capped final logits.
    gemma_norms: bool = False
    embed_scale: float | None = None
    attention_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    # Mixture of experts: experts per MoE layer, chosen per token, their MLP width, and
    # whether the chosen weights are renormalised to sum to 1; which layers route.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path, fingerprint: bool = True) -> ModelConfig:
        """Read ``path/config.json`` (and ``generation_config.json`` for EOS ids).
        ``fingerprint=False`` leaves the fingerprint empty rather than hashing every weight
        (for reading a config without serving it)."""
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{path}: architecture {archs} is not supported; pdserve serves "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if family == "gemma3":
            # A multimodal checkpoint's text model; keys left out take transformers' defaults.
            top, text = raw, raw.get("text_config") or raw
            dtype = raw.get("dtype") or raw.get("torch_dtype") or text.get("torch_dtype")
            raw = {**GEMMA3_TEXT_DEFAULTS, **text, "dtype": dtype}
            if "eos_token_id" in top:
                raw["eos_token_id"] = top["eos_token_id"]
        num_heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        biased_qkv = family == "qwen2"
        windows = _layer_windows(family, raw, num_layers)
        experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
        gemma = family == "gemma3"
        if gemma and raw.get("attn_logit_softcapping") is not None:
            # transformers' Gemma 3 does not apply it either: refuse rather than guess.
            raise ValueError(f"{path}: Gemma 3 with attn_logit_softcapping is not supported")
        if family in ("mixtral", "qwen3_moe") and experts <= 0:
            raise ValueError(f"{path}: a {arch} config without experts")
        return cls(
            path=path,
            architecture=arch,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw.get("intermediate_size") or 0,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            attention_bias=biased_qkv or bool(raw.get("attention_bias", False)),
            o_proj_bias=not biased_qkv and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            checkpoint_dtype=str(dtype).removeprefix("torch."),
            eos_token_ids=_eos_ids(path, raw),
            fingerprint=model_fingerprint(path) if fingerprint else b"",
            family=family,
            layer_windows=windows,
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            gemma_norms=gemma,
            embed_scale=raw["hidden_size"] ** 0.5 if gemma else None,
            attention_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5 if gemma else None,
            final_logit_softcapping=raw.get("final_logit_softcapping") if gemma else None,
            num_experts=experts,
            num_experts_per_tok=raw.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=(
                raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0
                if experts
                else 0
            ),
            # Mixtral always renormalises the chosen weights; Qwen3-MoE as its config says.
            norm_topk_prob=family == "mixtral" or bool(raw.get("norm_topk_prob", False)),
            moe_layers=_moe_layers(family, raw, num_layers, experts),
        )

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def release_window(self) -> int:
        """Where every layer slides, the widest window (blocks older than it are never
        read again); else 0."""
        if self.layer_windows and all(self.layer_windows):
            return max(self.layer_windows)
        return 0

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of KV cache one token takes, all layers, at ``itemsize`` bytes a value."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def max_model_len(self, requested: int | None) -> int:
        """``--max-model-len``, or the model's own limit when unset; more than it supports is
        refused (SettingsError)."""
        limit = self.max_position_embeddings
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


def _layer_windows(family: str, raw: dict, num_layers: int) -> tuple[int, ...]:
    """Each layer's attention window (0: the whole context), by transformers' rules: its
    ``layer_types`` where config.json lists them, else each family's own."""
    window = raw.get("sliding_window")
    window = window if isinstance(window, int) and window > 0 else 0
    types = raw.get("layer_types")
    if family == "gemma3" and not types:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if not types:
        if family in ("qwen2", "qwen3", "qwen3_moe"):
            slides = raw.get("use_sliding_window", False)
            first = raw.get("max_window_layers", num_layers)
            types = [
                "sliding_attention" if slides and i >= first else "full_attention"
                for i in range(num_layers)
            ]
        elif family in ("mistral", "mixtral"):
            types = ["sliding_attention"] * num_layers
        else:
            types = ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {num_layers}")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = 0  # transformers drops the window unless use_sliding_window is set
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _moe_layers(family: str, raw: dict, num_layers: int, experts: int) -> tuple[bool, ...]:
    """Which layers route over experts (Qwen3-MoE: every ``decoder_sparse_step``-th, less
    ``mlp_only_layers``; Mixtral: all)."""
    if family == "mixtral":
        return (True,) * num_layers
    if family != "qwen3_moe":
        return (False,) * num_layers
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


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
