"""`pdserve prepare-model --model DIR`: check a local Hugging Face checkpoint of any served
architecture and write a copy that the engine loads as it is.

What the copy holds: config.json, generation_config.json and the tokenizer's files as
they are; the weights as safetensors shards (from ``*.safetensors`` or from PyTorch's
``*.bin`` files, loaded with ``weights_only``), less what a text model does not load (a
multimodal Gemma 3's vision tower); its model fingerprint and the mark of a finished
preparation. Before writing, every weight the model needs is checked to be there with
its shape (from the files' headers, through the loader's own name mapping), so a
checkpoint that would fail at a worker's start fails here, naming what is wrong.

``describe`` gives what the copy costs to serve: parameters, and KV cache bytes per token.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.core.fingerprint import store_fingerprint
from pdserve.core.model import COMPLETE_MARKER, ModelConfig
from pdserve.engine.model.loader import _map_expert, _map_name, build_on_meta, parameter_count

logger = logging.getLogger(__name__)

# Files copied as they are (the tokenizer's, the configs, a chat template).
_COPIED_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_SHARD_BYTES = 4 << 30


@dataclass(frozen=True)
class ModelSummary:
    architecture: str
    parameters: int
    kv_bytes_per_token: int  # at the checkpoint's dtype (bfloat16 where it says none)
    layers: int
    windows: tuple[int, ...]
    experts: int
    experts_per_token: int

    def lines(self) -> list[str]:
        slides = sum(1 for w in self.windows if w)
        attention = (
            f"{slides} of {self.layers} layers sliding (window {max(self.windows)})"
            if slides
            else f"{self.layers} layers, full attention"
        )
        out = [
            f"architecture: {self.architecture}",
            f"parameters: {self.parameters:,} ({self.parameters / 1e9:.2f} B)",
            f"KV cache per token: {self.kv_bytes_per_token:,} bytes",
            f"attention: {attention}",
        ]
        if self.experts:
            out.append(f"experts: {self.experts}, {self.experts_per_token} chosen per token")
        return out


def _dtype(cfg: ModelConfig) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16}.get(
        cfg.checkpoint_dtype, torch.bfloat16
    )


def describe(cfg: ModelConfig) -> ModelSummary:
    """Parameters and KV bytes per token of ``cfg``'s model, from a build on the meta device."""
    dtype = _dtype(cfg)
    model = build_on_meta(cfg, dtype)
    return ModelSummary(
        architecture=cfg.architecture,
        parameters=parameter_count(model),
        kv_bytes_per_token=cfg.kv_bytes_per_token(dtype.itemsize),
        layers=cfg.num_layers,
        windows=cfg.layer_windows,
        experts=cfg.num_experts,
        experts_per_token=cfg.num_experts_per_tok,
    )


def _weight_files(source: Path) -> list[Path]:
    files = sorted(source.glob("*.safetensors")) or sorted(source.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{source}: no *.safetensors or pytorch_model*.bin weight files")
    return files


def _read(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".bin":
        # Mapped, not read: the check reads only the shapes (a pre-1.6 file cannot be).
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            return torch.load(path, map_location="cpu", weights_only=True)
    from safetensors.torch import load_file

    return load_file(path)


def _kept(name: str) -> bool:
    """Whether the text model loads weight ``name``."""
    return _map_expert(name) is not None or _map_name(name)[0] is not None


def check_weights(cfg: ModelConfig, names_shapes: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming what a model of ``cfg`` lacks or cannot take among these weights."""
    model = build_on_meta(cfg)
    needed = {n: tuple(p.shape) for n, p in model.named_parameters()}
    got: set[str] = set()
    for name, shape in names_shapes.items():
        expert = _map_expert(name)
        if expert is not None:
            got.add(expert[0])
            continue
        target, part, _ = _map_name(name)
        if target is None:
            continue
        if target not in needed:
            if target == "lm_head.weight":
                continue  # a tied checkpoint that also stores the head
            raise ValueError(f"weight {name!r} has no place in a {cfg.architecture} model")
        if part is None and needed[target] != shape:
            raise ValueError(f"weight {name}: shape {shape}, the model takes {needed[target]}")
        got.add(target)
    missing = sorted(n for n in needed if n not in got)
    if missing:
        raise ValueError(f"the checkpoint lacks weights for {missing[:8]}")


def _names_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        if f.suffix == ".bin":
            out.update({n: tuple(t.shape) for n, t in _read(f).items()})
            continue
        from safetensors import safe_open

        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                out[name] = tuple(st.get_slice(name).get_shape())
    return out


def convert_local(source: Path, target: Path, force: bool = False) -> ModelSummary:
    """Check ``source`` and write the copy at ``target`` (refused where a prepared one is,
    unless ``force``). ValueError for an unsupported or broken checkpoint."""
    source, target = Path(source).resolve(), Path(target)
    # Refuses an unsupported architecture, naming the list; the copy gets the fingerprint
    # (hashing the source's weights too would read them once more, and write beside them).
    cfg = ModelConfig.from_dir(source, fingerprint=False)
    files = _weight_files(source)
    check_weights(cfg, _names_shapes(files))
    if target.resolve() == source:
        raise ValueError("--output is the source directory: name another one")
    if (target / COMPLETE_MARKER).exists() and not force:
        logger.info("%s is prepared already (--force converts again)", target)
        return describe(ModelConfig.from_dir(target))
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix in _COPIED_SUFFIXES and not f.name.startswith("."):
            if f.name.endswith(".index.json"):
                continue  # the shards' index is written anew
            shutil.copy2(f, tmp / f.name)
    _write_shards(files, tmp)
    store_fingerprint(tmp)
    (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(source)}) + "\n")
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return describe(ModelConfig.from_dir(target))


def _write_shards(files: list[Path], out: Path) -> None:
    """The text model's weights as safetensors shards of about _SHARD_BYTES, with an index
    where there are several."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for f in files:
        for name, tensor in _read(f).items():
            if not _kept(name):
                continue
            if size and size + tensor.nbytes > _SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = tensor.contiguous()
            size += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    index: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1) + "\n"
    )
