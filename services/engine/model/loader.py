"""Build a model from a checkpoint directory: config, rotary tables, safetensors weights."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.core.model import ModelConfig
from pdserve.engine.model.llama import LlamaForCausalLM, Rotary

logger = logging.getLogger(__name__)

# Hugging Face names of the pieces that we fuse: fused name -> parts in order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def rope_tables(cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> Rotary:
    """Rotary tables: plain rope from config.json, any other type by transformers' own init
    functions, so that every rope type matches it (importing transformers costs a second
    or more of a worker's start, so the plain case does without)."""
    theta = _plain_rope_theta(Path(cfg.path))
    if theta is None:
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = AutoConfig.from_pretrained(cfg.path)
        params = getattr(hf, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "dynamic":
            raise ValueError(f"{cfg.path}: dynamic NTK rope scaling is not supported")
        if rope_type != "default":
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
            return Rotary(inv_freq, scaling, max_positions, dtype)
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    d = cfg.head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    return Rotary(inv_freq, 1.0, max_positions, dtype)


def _plain_rope_theta(path: Path) -> float | None:
    """The base of a plain (unscaled, full-width) rope as config.json gives it; None for
    anything else, which transformers then reads."""
    raw = json.loads((path / "config.json").read_text())
    params = raw.get("rope_parameters") or {}
    if raw.get("rope_scaling") or raw.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    if params.get("rope_type", params.get("type", "default")) != "default":
        return None
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    return float(theta) if isinstance(theta, int | float) else None


_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_random_init():
    """nn.Linear and nn.Embedding skip their random init (the checkpoint's weights replace
    it), as transformers' ``no_init_weights`` does."""
    with _INIT_LOCK:
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = _no_init
        try:
            yield
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _no_init(module: nn.Module) -> None:
    pass


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
    """The model with its weights, in ``dtype`` on ``device``, ready for inference."""
    # Built on the meta device without the modules' random init, and with a placeholder
    # table made outside it: random init and torch.arange on the meta device run through
    # torch._refs, whose import of dynamo costs seconds of an eager worker's start.
    placeholder = rope_tables(cfg, 1, dtype)
    with torch.device("meta"), _without_random_init():
        model = LlamaForCausalLM(cfg, placeholder)
    # Storage for every tensor, uninitialised (no float32 copy on the way). torch.empty,
    # not to_empty's empty_like, whose meta-tensor path imports sympy.
    model = model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if cfg.tie_word_embeddings:  # _apply makes a parameter per use: tie again
        model.lm_head.weight = model.embed_tokens.weight
    # Built after _apply, which would wipe its buffers.
    model.rotary = rope_tables(cfg, max_positions, dtype).to(device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    files = sorted(Path(cfg.path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{cfg.path}: no *.safetensors weight files")
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                target, part, all_parts = _map_name(name)
                if target is None:
                    continue
                tensor = st.get_tensor(name)
                if part is None:
                    _copy(params, target, tensor)
                    loaded.add(target)
                    continue
                pending.setdefault(target, {})[part] = tensor
                if len(pending[target]) == len(all_parts):
                    parts = pending.pop(target)
                    _copy(params, target, torch.cat([parts[p] for p in all_parts]))
                    loaded.add(target)
    missing = set(params) - loaded
    if pending or missing:
        raise ValueError(
            f"{cfg.path}: checkpoint lacks weights for {sorted(missing | set(pending))[:8]}"
        )
    model.eval()
    return model


def _map_name(name: str) -> tuple[str | None, str | None, tuple[str, ...]]:
    """HF weight name -> (our parameter, its fused part or None, all parts); target None to skip."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if "rotary_emb" in name:
        return None, None, ()
    for fused, parts in _FUSED.items():
        for part in parts:
            if f".{part}." in name:
                return name.replace(part, fused), part, parts
    return name, None, ()


def _copy(params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    if name not in params:
        if name == "lm_head.weight":  # a tied checkpoint that also stores the head
            return
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    p = params[name]
    if p.shape != tensor.shape:
        raise ValueError(
            f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(p.shape)}"
        )
    with torch.no_grad():
        p.copy_(tensor)
