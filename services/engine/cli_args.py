"""Command-line flags for EngineArgs, shared by every command that runs an engine."""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, fields

from services.engine.config import EngineArgs

_HELP = {
    "model": "checkpoint directory (Hugging Face Llama/Qwen2/Mistral layout); default: the "
    "prepared SmolLM2-135M-Instruct (see `pdserve prepare-model`)",
    "dtype": "weights and KV cache dtype: auto (the checkpoint's), float32, bfloat16, float16",
    "device": "auto (cuda if available, else cpu), cpu, or cuda[:N]",
    "block_size": "tokens per KV block (a power of two)",
    "kv_cache_memory": "memory for the KV cache, e.g. 512MiB or 2GiB",
    "num_kv_blocks": "number of KV blocks (overrides --kv-cache-memory)",
    "max_num_batched_tokens": "token budget of one step; longer prompts are prefilled in chunks",
    "max_num_seqs": "most sequences running at once",
    "max_model_len": "longest prompt + output in tokens (default: the model's limit)",
    "enable_prefix_caching": "reuse KV blocks of earlier prompts with the same prefix",
    "attention_backend": "auto (triton on CUDA, torch elsewhere), torch or triton",
    "num_threads": "torch CPU threads (default: torch's choice)",
    "seed": "seed of unseeded random sampling",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineArgs field; ``PDSERVE_<FIELD>`` in the environment sets its default."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        env = os.environ.get("PDSERVE_" + f.name.upper())
        default = f.default if f.default is not MISSING else None
        help_text = f"{_HELP.get(f.name, '')} [env PDSERVE_{f.name.upper()}; default: {default}]"
        if isinstance(default, bool):
            if env is not None:
                default = env.lower() in ("1", "true", "yes", "on")
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        kind = (
            int
            if f.name
            in (
                "block_size",
                "num_kv_blocks",
                "max_num_batched_tokens",
                "max_num_seqs",
                "max_model_len",
                "num_threads",
                "seed",
            )
            else str
        )
        if env is not None:
            default = kind(env)
        group.add_argument(flag, type=kind, default=default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags; a bad value raises ValueError saying what to change."""
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})
