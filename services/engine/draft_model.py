"""The draft-model proposer: a smaller checkpoint with the same tokenizer, run greedily by
the decode worker beside the target, with its own paged KV cache.

Each request that may speculate has a shadow here: a sequence over the draft's cache that
mirrors the request's tokens. At every step the shadows catch up with their requests (the
tokens the last verification kept; the drafts it rejected are rolled back, their blocks
returned), in one batched draft step that also draws the first draft of each, then take
k - 1 more one-token draft steps together. A shadow whose catch-up does not fit the step's
token budget catches up in chunks and proposes once it has.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch

from pdserve.core.model import ModelConfig
from pdserve.core.sampling import SamplingParams
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.settings.engine import EngineArgs
from pdserve.settings.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)


class DraftModelProposer:
    """Greedy drafts of ``config.model`` for many requests at once (``propose_all``)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target_args: EngineArgs,
        target: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        num_blocks: int,
    ) -> None:
        from pdserve.engine.model_runner import ModelRunner

        if not (Path(config.model) / "config.json").is_file():
            raise ValueError(
                f"--speculative-config: the draft model {config.model} is not a checkpoint "
                "directory (a local Hugging Face layout with config.json and safetensors)"
            )
        draft = ModelConfig.from_dir(config.model)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"--speculative-config: the draft model {config.model} has a vocabulary of "
                f"{draft.vocab_size} tokens, the target {target.vocab_size}: a draft model "
                "must share the target's tokenizer"
            )
        args = dataclasses.replace(
            target_args, model=str(draft.path), speculative_config=None, enable_prefix_caching=False
        )
        self.budget = args.max_num_batched_tokens
        # As many blocks as the target has: a shadow never holds more tokens than its
        # request and its drafts.
        self.runner = ModelRunner(args, draft, dtype, device, max_model_len, num_blocks)
        self.kv = KVCacheManager(
            BlockPool(num_blocks), args.block_size, draft.fingerprint, enable_prefix_caching=False
        )
        self.shadows: dict[str, Sequence] = {}
        logger.info(
            "draft model %s: %d layers, %d KV blocks (%.1f MiB), step %s",
            draft.path,
            draft.num_layers,
            num_blocks,
            num_blocks * ModelRunner.block_bytes(draft, args.block_size, dtype) / 2**20,
            self.runner.mode,
        )

    def _sync(self, seq: Sequence) -> Sequence:
        """The request's shadow, holding its tokens, with the KV of what it had in common
        with them kept (drafts it proposed and the target rejected are dropped)."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, list(seq.token_ids), _GREEDY)
            self.shadows[seq.request_id] = shadow
            return shadow
        mine, theirs = shadow.token_ids, seq.token_ids
        common = 0
        limit = min(len(mine), len(theirs))
        while common < limit and mine[common] == theirs[common]:
            common += 1
        del mine[common:]
        mine.extend(theirs[common:])
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common)
        self.kv.trim(shadow)
        return shadow

    def propose_all(self, requests: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Up to ``room`` drafts for each (request, room)."""
        batch, rooms, budget = ScheduledBatch(), [], self.budget
        for seq, room in requests:
            shadow = self._sync(seq)
            if budget <= 0:
                continue
            n = min(shadow.num_tokens - shadow.num_computed_tokens, budget)
            caught_up = shadow.num_computed_tokens + n == shadow.num_tokens
            slots = n + (room - 1 if caught_up else 0)
            if not self.kv.allocate_slots(shadow, slots):
                continue
            batch.seqs.append(shadow)
            batch.num_new_tokens.append(n)
            rooms.append(room if caught_up else 0)
            budget -= n
        drafts: dict[str, list[int]] = {}
        if not batch:
            return drafts
        active = self._advance(batch)
        for shadow, room in zip(batch.seqs, rooms, strict=True):
            if room and shadow.request_id in active:
                drafts[shadow.request_id] = [active[shadow.request_id]]
        for j in range(1, max(rooms, default=0)):
            step = ScheduledBatch()
            for shadow, room in zip(batch.seqs, rooms, strict=True):
                if room > j and shadow.request_id in drafts:
                    step.seqs.append(shadow)
                    step.num_new_tokens.append(1)
            if not step:
                break
            for request_id, token in self._advance(step).items():
                drafts[request_id].append(token)
        return drafts

    def _advance(self, batch: ScheduledBatch) -> dict[str, int]:
        """Run one draft step; each shadow that drew a token keeps it; {request: token}."""
        out = self.runner.execute(batch)
        drawn = {}
        for shadow, n, tokens in zip(batch.seqs, batch.num_new_tokens, out.token_ids, strict=True):
            shadow.num_computed_tokens += n
            if tokens:
                shadow.token_ids.append(tokens[0])
                drawn[shadow.request_id] = tokens[0]
        return drawn

    def forget(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)


def write_layer_draft(source: Path, target: Path, num_layers: int) -> Path:
    """A draft checkpoint made of ``source``'s first ``num_layers`` decoder layers (and its
    embeddings, final norm, head and tokenizer): a self-draft with the same tokenizer."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(
            f"--draft-layers must be in [1, {config['num_hidden_layers']}], got {num_layers}"
        )
    target.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no iteration)
                parts = name.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                    continue
                tensors[name] = f.get_tensor(name)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "max_window_layers"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for item in source.iterdir():  # tokenizer, chat template, generation config
        weights = item.suffix == ".safetensors" or item.name.endswith(".safetensors.index.json")
        if item.is_file() and not weights and item.name != "config.json":
            shutil.copy2(item, target / item.name)
    return target
