"""pdserve's bfloat16 greedy output against transformers' bfloat16, on the exactness prompts.

    .venv/bin/python -m bench.engine.bf16_agreement [--max-new 64] [--write-results]

fp32 is the exactness contract (token for token, near-ties only); bf16 is where the speed
is on CPUs with AMX, and two bf16 implementations round differently (fused projections,
other GEMM kernels, another attention), so their greedy paths part at some point. This
reports, for each of the SmolLM2 exactness chats: how many tokens agree before the first
difference, and at that token the gap between transformers' two best bf16 logits, in bf16
steps at the logit's magnitude (2^-8 relative). Within 2 steps is a tie at bf16 precision:
the final projection alone rounds each logit by up to half a step, and 30 layers of bf16
activations before it differ between the two implementations by more.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from bench import ROOT
from bench.results_md import replace_section
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.prepare_model import resolve_model
from pdserve.testing.reference import CHATS, hf_greedy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args(argv)
    path = resolve_model(None)
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=2048)
    prompts = [llm.tokenizer.apply_chat_template(c) for c in CHATS]
    ref = hf_greedy(path, prompts, args.max_new, dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=args.max_new, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    rows, agreed = [], 0
    for k, (out, r) in enumerate(zip(outs, ref, strict=True)):
        tokens = r.tokens
        n = next(
            (i for i, (a, b) in enumerate(zip(out.token_ids, tokens, strict=True)) if a != b), None
        )
        if n is None:
            agreed += 1
            rows.append(f"| {k} | {len(prompts[k])} | all {len(tokens)} | - | - |")
            continue
        best, gap = r.best[n], r.gaps[n]
        step = 2.0 ** (math.floor(math.log2(abs(best))) - 7) if best else 2.0**-126
        tie = "yes" if gap <= 2 * step else "no"
        rows.append(
            f"| {k} | {len(prompts[k])} | {n} | {gap:.4f} ({gap / step:.0f} steps) | {tie} |"
        )
        print(f"prompt {k}: first difference at token {n}, gap {gap:.4f}, tie: {tie}")
    text = "\n".join(
        [
            "## bf16 greedy output against transformers' bf16",
            "",
            f"SmolLM2-135M-Instruct, the {len(CHATS)} chats of the fp32 exactness test, "
            f"{args.max_new} greedy tokens each, pdserve (compiled step, bf16 weights and KV) "
            "against transformers `generate` in bf16. Columns: prompt tokens; tokens equal "
            "before the first difference; transformers' top-2 bf16 logit gap at that token "
            "(in bf16 steps at the logit's magnitude); whether that gap is within 2 steps "
            "(a tie at bf16 precision, see the script's docstring).",
            "",
            "| chat | prompt tokens | equal tokens | top-2 gap there | bf16 tie |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"{agreed} of {len(CHATS)} chats agree on all {args.max_new} tokens.",
            "",
            "Command: `.venv/bin/python -m bench.engine.bf16_agreement --write-results`",
        ]
    )
    print(text)
    if args.write_results:
        replace_section(ROOT / "bench/RESULTS.md", "bf16-agreement", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
