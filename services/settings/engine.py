"""``EngineArgs``: everything that shapes an engine, the flags every worker takes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from pdserve.settings.flags import check, setting
from pdserve.settings.sizes import size_setting
from pdserve.settings.speculative import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes an engine (each field is a flag, e.g. ``--max-num-seqs``)."""

    GROUP: ClassVar[str] = "engine"

    model: str | None = setting(
        None,
        "checkpoint directory (Hugging Face layout: Llama, Mistral, Qwen2/3, Gemma 3, Mixtral, "
        "Qwen3-MoE); default: the "
        "prepared SmolLM2-135M-Instruct (see `pdserve prepare-model`)",
    )
    dtype: str = setting(
        "auto",
        "weights and KV cache dtype: auto (the checkpoint's on CUDA; on the CPU the faster of "
        "float32 and bfloat16, timed once on this machine), float32 (the exactness mode), "
        "bfloat16, float16",
    )
    device: str = setting("auto", "auto (cuda if available, else cpu), cpu, or cuda[:N]")
    block_size: int = setting(16, "tokens per KV block (a power of two)")
    kv_cache_memory: str = setting(
        "1GiB",
        "memory for the KV cache, e.g. 512MiB or 2GiB (each rank's, with "
        "--tensor-parallel-size: a rank holds its KV heads of every block)",
    )
    num_kv_blocks: int | None = setting(None, "number of KV blocks (overrides --kv-cache-memory)")
    max_num_batched_tokens: int = setting(
        1024, "token budget of one step; longer prompts are prefilled in chunks"
    )
    max_num_seqs: int = setting(64, "most sequences running at once")
    max_model_len: int | None = setting(
        None, "longest prompt + output in tokens (default: the model's limit)"
    )
    enable_prefix_caching: bool = setting(
        True, "reuse KV blocks of earlier prompts with the same prefix"
    )
    attention_backend: str = setting(
        "auto",
        "auto (triton on CUDA; on the CPU the C kernels, or torch where they do not build), "
        "cpu, torch (the plain-torch reference) or triton",
    )
    enforce_eager: bool = setting(
        False,
        "run the plain PyTorch model: no CUDA graphs on CUDA, no inductor compile on the CPU",
    )
    tensor_parallel_size: int = setting(
        1,
        "processes (ranks) one engine's model is split over, by attention and KV head, MLP "
        "column/row and vocabulary; rank 0 is the worker, which starts the others and stops "
        "with any of them. It must divide the model's attention and KV heads and its "
        "intermediate size. On CUDA rank r takes the device after --device's by r; on the "
        "CPU the ranks share the cores (each takes --num-threads)",
    )
    num_threads: int | None = setting(None, "torch CPU threads (default: torch's choice)")
    seed: int = setting(0, "seed of unseeded random sampling")
    speculative_config: str | None = setting(
        None,
        "speculative decoding, a JSON object as vLLM's, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        "(fields: method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, model, "
        "disable_by_batch_size, min_acceptance_rate; docs/speculative.md); decode workers "
        "speculate, prefill workers ignore it; unset: no speculation",
        metavar="JSON",
    )
    grammar_compile_timeout: float = setting(
        10.0,
        "seconds a worker may spend compiling one request's structured output (JSON schema, "
        "regex, choice or grammar), off the engine thread; past it the request is refused "
        "(400). Compiled grammars are cached per worker",
    )

    def __post_init__(self) -> None:
        SpeculativeConfig.parse(self.speculative_config)  # refuses a bad field by its name
        check(
            self.dtype in ("auto", *DTYPES),
            f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
        )
        check(
            self.device == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            f"--device must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            f"--block-size must be a power of two, got {self.block_size!r}",
        )
        check(
            size_setting("--kv-cache-memory", self.kv_cache_memory) > 0,
            "--kv-cache-memory must be positive",
        )
        for flag, value, least in (
            ("--num-kv-blocks", self.num_kv_blocks, 1),
            ("--max-num-batched-tokens", self.max_num_batched_tokens, 1),
            ("--max-num-seqs", self.max_num_seqs, 1),
            ("--max-model-len", self.max_model_len, 2),
            ("--num-threads", self.num_threads, 1),
            ("--tensor-parallel-size", self.tensor_parallel_size, 1),
        ):
            check(value is None or value >= least, f"{flag} must be >= {least}, got {value}")
        check(
            self.grammar_compile_timeout > 0,
            f"--grammar-compile-timeout must be positive seconds, got "
            f"{self.grammar_compile_timeout}",
        )
        check(
            self.attention_backend in ("auto", "cpu", "torch", "triton"),
            f"--attention-backend must be auto, cpu, torch or triton, got "
            f"{self.attention_backend!r}",
        )
