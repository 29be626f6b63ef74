"""Decode tokens/s of a small mixture-of-experts model in the engine, by how the expert op
computes (``pdserve.engine.model.moe.expert_path``): grouped by expert (pdserve's), the
same with each projection in one ``torch._grouped_mm`` call, the expert loop of
transformers (a mask search per chosen expert), and the dense loop of every expert over
every token.

The model is random, Mixtral-shaped and small enough for a laptop: 4 layers, hidden 512,
``--experts`` experts of width 512 (default 32), ``--chosen`` of them per token (2). Each path generates ``--tokens`` tokens for
``--streams`` prompts of 32 tokens, float32, after a warm-up; the figure is the median
over ``--repeats`` runs of output tokens per second of the whole generate call, with the
steps (all decode but the first) run compiled unless ``--eager``.

    .venv/bin/python -m bench.engine.moe_step [--streams 1 16] [--tokens 64] [--eager]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build_checkpoint(path: Path, experts: int, chosen: int) -> Path:
    from transformers import AutoModelForCausalLM, MixtralConfig

    from pdserve.testing.tiny_models import build_tiny_tokenizer

    config = MixtralConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=chosen,
        max_position_embeddings=1024,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def tokens_per_second(llm, streams: int, tokens: int, repeats: int) -> float:
    from pdserve.engine import SamplingParams

    prompts = [[(7 * i + j) % 500 + 3 for j in range(32)] for i in range(streams)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate(prompts, params)
        rates.append(streams * tokens / (time.perf_counter() - started))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--chosen", type=int, default=2)
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()

    from pdserve.engine import LLM
    from pdserve.engine.model import moe

    path = build_checkpoint(Path(tempfile.mkdtemp()), args.experts, args.chosen)
    llm = LLM(model=str(path), dtype="float32", enforce_eager=args.eager, num_kv_blocks=512)
    print(
        f"threads {torch.get_num_threads()}, mode {llm.engine.runner.mode}, "
        f"{args.experts} experts, {args.chosen} chosen"
    )
    print("| streams | " + " | ".join(moe.EXPERT_PATHS) + " | grouped / dense |")
    print("|---|" + "---|" * (len(moe.EXPERT_PATHS) + 1))
    for streams in args.streams:
        rates = {}
        for path_name in moe.EXPERT_PATHS:
            moe.expert_path = path_name
            rates[path_name] = tokens_per_second(llm, streams, args.tokens, args.repeats)
        moe.expert_path = "grouped"
        cells = " | ".join(f"{rates[p]:.0f} tok/s" for p in moe.EXPERT_PATHS)
        print(f"| {streams} | {cells} | {rates['grouped'] / rates['dense']:.2f}x |")


if __name__ == "__main__":
    main()
