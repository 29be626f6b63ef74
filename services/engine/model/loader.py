"""Build a model from a checkpoint directory: config, rotary tables, safetensors weights."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.core.model import ModelConfig
from pdserve.engine.model.llama import LlamaForCausalLM, Rotary
from pdserve.engine.tensor_parallel import ONE_RANK, Shard

logger = logging.getLogger(__name__)

# Hugging Face names of the pieces that we fuse: fused name -> parts in order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def rope_tables(
    cfg: ModelConfig, max_positions: int, dtype: torch.dtype, layer_type: str | None = None
) -> Rotary:
    """Rotary tables: plain rope from config.json, any other type by transformers' own init
    functions, so that every rope type matches it (importing transformers costs a second
    or more of a worker's start, so the plain case does without). ``layer_type``
    ("full_attention", "sliding_attention"): the tables of that layer type, for a model
    with rope parameters per type (Gemma 3)."""
    if layer_type is not None:
        return _layer_type_rope(cfg, max_positions, dtype, layer_type)
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


def _layer_type_rope(
    cfg: ModelConfig, max_positions: int, dtype: torch.dtype, layer_type: str
) -> Rotary:
    """Gemma 3's tables of one layer type, by transformers' reading of the config (which
    turns its older keys, rope_local_base_freq and rope_scaling, into per-type
    parameters)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.from_pretrained(cfg.path)
    hf = getattr(hf, "text_config", None) or hf
    params = (getattr(hf, "rope_parameters", None) or {}).get(layer_type) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError(f"{cfg.path}: dynamic NTK rope scaling is not supported")
    if rope_type != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
            hf, torch.device("cpu"), layer_type=layer_type
        )
        return Rotary(inv_freq, scaling, max_positions, dtype)
    d = cfg.head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    return Rotary(inv_freq, 1.0, max_positions, dtype)


def _rotaries(
    cfg: ModelConfig, max_positions: int, dtype: torch.dtype
) -> tuple[Rotary, Rotary | None]:
    """The model's tables, and those of its sliding layers where they differ (Gemma 3)."""
    if cfg.family != "gemma3":
        return rope_tables(cfg, max_positions, dtype), None
    full = rope_tables(cfg, max_positions, dtype, "full_attention")
    return full, rope_tables(cfg, max_positions, dtype, "sliding_attention")


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


def build_on_meta(
    cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, shard: Shard = ONE_RANK
) -> LlamaForCausalLM:
    """The model's modules with no storage (the meta device): its shapes, for describing a
    checkpoint without reading its weights."""
    placeholder, local_placeholder = _rotaries(cfg, 1, dtype)
    with torch.device("meta"), _without_random_init():
        return LlamaForCausalLM(cfg, placeholder, local_placeholder, shard).to(dtype)


def parameter_count(model: nn.Module) -> int:
    """Parameters of ``model``, a tied one counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    shard: Shard = ONE_RANK,
) -> LlamaForCausalLM:
    """The model with its weights, in ``dtype`` on ``device``, ready for inference;
    ``shard``: this rank's part of them (each weight read whole, then cut)."""
    # Built on the meta device without the modules' random init, and with a placeholder
    # table made outside it: random init and torch.arange on the meta device run through
    # torch._refs, whose import of dynamo costs seconds of an eager worker's start.
    model = build_on_meta(cfg, dtype, shard)
    # Storage for every tensor, uninitialised (no float32 copy on the way). torch.empty,
    # not to_empty's empty_like, whose meta-tensor path imports sympy.
    model = model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if cfg.tie_word_embeddings:  # _apply makes a parameter per use: tie again
        model.lm_head.weight = model.embed_tokens.weight
    # Built after _apply, which would wipe its buffers.
    rotary, local_rotary = _rotaries(cfg, max_positions, dtype)
    model.rotary = rotary.to(device)
    model.local_rotary = local_rotary.to(device) if local_rotary is not None else None
    if cfg.embed_scale is not None:  # rounded to the dtype, as transformers' buffer is
        model.embed_scale = float(torch.tensor(cfg.embed_scale, dtype=dtype))
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    expert_parts: dict[str, set[tuple[int, str]]] = {}
    files = sorted(Path(cfg.path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{cfg.path}: no *.safetensors weight files")
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                expert = _map_expert(name)
                if expert is not None:
                    target, index, part = expert
                    tensor = _shard_expert(st.get_tensor(name), part, index, cfg, shard)
                    _copy_expert(params, target, index, part, tensor, cfg, shard)
                    got = expert_parts.setdefault(target, set())
                    got.add((index, part))
                    if index < 0 or len(got) == _expert_slices(target, cfg):
                        loaded.add(target)
                    continue
                target, part, all_parts = _map_name(name)
                if target is None:
                    continue
                tensor = _shard_weight(st.get_tensor(name), target, part, cfg, shard)
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


# Prefixes of a multimodal checkpoint's text model (Gemma 3), in transformers 5 and 4 naming.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")
# Parts of a multimodal checkpoint that a text model does not load.
_NOT_TEXT = ("vision_tower", "multi_modal_projector", "vision_model", "visual.")

# An expert's weights in the checkpoint: Mixtral's w1 (gate), w3 (up), w2 (down), and
# Qwen3-MoE's gate_proj, up_proj, down_proj, or both stacked over all experts as
# transformers 5 holds them (gate_up_proj [E, 2I, H], down_proj [E, H, I]).
_EXPERT = re.compile(
    r"^layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\."
    r"(?:(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$"
)
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}


def _strip(name: str) -> str:
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name.removeprefix("model.")


def _map_expert(name: str) -> tuple[str, int, str] | None:
    """An expert weight's (our stacked parameter, expert index or -1 for all, part: "gate",
    "up", "down", "gate_up"); None for any other weight."""
    m = _EXPERT.match(_strip(name))
    if m is None:
        return None
    layer, index, part, stacked = m.groups()
    if stacked:
        target = "w13" if stacked == "gate_up_proj" else "w2"
        return f"layers.{layer}.mlp.{target}", -1, stacked
    kind = _EXPERT_PART.get(part, "down")
    target = "w2" if kind == "down" else "w13"
    return f"layers.{layer}.mlp.{target}", int(index), kind


def _expert_slices(target: str, cfg: ModelConfig) -> int:
    """How many pieces fill ``target``: one per expert for w2, two (gate, up) for w13."""
    return cfg.num_experts * (2 if target.endswith("w13") else 1)


def _copy_expert(
    params: dict[str, torch.nn.Parameter],
    target: str,
    index: int,
    part: str,
    tensor: torch.Tensor,
    cfg: ModelConfig,
    shard: Shard = ONE_RANK,
) -> None:
    p = params.get(target)
    if p is None:
        raise ValueError(f"unexpected expert weight for {target!r} in checkpoint")
    inter = cfg.moe_intermediate_size // shard.size
    if index < 0:  # all experts at once: counts as every slice
        dst = p
    elif part == "gate":
        dst = p[index, :inter]
    elif part == "up":
        dst = p[index, inter:]
    else:
        dst = p[index]
    if dst.shape != tensor.shape:
        raise ValueError(
            f"expert weight {target}[{index}] {part}: checkpoint shape {tuple(tensor.shape)} "
            f"!= model {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(tensor)


def _map_name(name: str) -> tuple[str | None, str | None, tuple[str, ...]]:
    """HF weight name -> (our parameter, its fused part or None, all parts); target None to skip."""
    if any(part in name for part in _NOT_TEXT):
        return None, None, ()
    name = _strip(name)
    if "rotary_emb" in name:
        return None, None, ()
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
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


# --- tensor parallelism: each rank's part of a weight --------------------------------
# Column parallel (rows of the weight cut): q, k, v, gate, up; row parallel (columns cut):
# o_proj, down_proj, whose bias only rank 0 adds; the vocabulary's rows cut: embedding and
# LM head (the last rank's padded with zeros); every other weight whole.
_ROWS = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "kv",
    "self_attn.v_proj": "kv",
    "mlp.gate_proj": "inter",
    "mlp.up_proj": "inter",
}
_COLUMNS = {"self_attn.o_proj": "q", "mlp.down_proj": "inter"}


def _shard_size(kind: str, cfg: ModelConfig) -> int:
    return {
        "q": cfg.num_heads * cfg.head_dim,
        "kv": cfg.num_kv_heads * cfg.head_dim,
        "inter": cfg.intermediate_size,
    }[kind]


def _shard_weight(
    tensor: torch.Tensor, target: str, part: str | None, cfg: ModelConfig, shard: Shard
) -> torch.Tensor:
    """This rank's part of one (unfused) checkpoint weight mapped to ``target``."""
    if shard.size == 1:
        return tensor
    if target in ("embed_tokens.weight", "lm_head.weight"):
        start, end = shard.vocab_range(cfg.vocab_size)
        out = tensor.new_zeros(shard.vocab_part(cfg.vocab_size), tensor.shape[1])
        out[: end - start] = tensor[start:end]
        return out
    if part in _ROWS:  # a piece of a fused qkv_proj or gate_up_proj, weight or bias
        start, end = shard.range(_shard_size(_ROWS[part], cfg))
        return tensor[start:end]
    for name, kind in _COLUMNS.items():
        if f".{name}." in f".{target}":
            if target.endswith(".bias"):
                return tensor if shard.rank == 0 else torch.zeros_like(tensor)
            start, end = shard.range(_shard_size(kind, cfg))
            return tensor[:, start:end]
    return tensor


def _shard_expert(
    tensor: torch.Tensor, part: str, index: int, cfg: ModelConfig, shard: Shard
) -> torch.Tensor:
    """This rank's part of an expert weight: gate/up rows, down columns, of each expert's
    intermediate size (``index`` -1: all experts stacked)."""
    if shard.size == 1:
        return tensor
    inter = cfg.moe_intermediate_size
    start, end = shard.range(inter)
    if part == "gate_up_proj":  # all experts: [E, 2I, H]
        return torch.cat([tensor[:, start:end], tensor[:, inter + start : inter + end]], dim=1)
    if part in ("down_proj", "down"):  # all experts' [E, H, I], or one's [H, I]
        return tensor[..., start:end]
    return tensor[start:end]  # one expert's gate or up: [I, H]
