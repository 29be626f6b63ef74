"""What the top-p filter costs a sampled step: the nucleus looked for among the most probable
tokens first (``top_p_filtered``) against a sort of every row's whole vocabulary.

    .venv/bin/python -m bench.engine.top_p [--rows 16] [--repeats 30]

The logits are SmolLM2-135M-Instruct's own (the prepared checkpoint, one forward over a
fixed English text, float32), so that the nuclei have a language model's sizes. The two
filters run interleaved in one process; medians of ``--repeats`` calls, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.timing import median_ms
from pdserve.engine.prepare_model import prepare_default_model
from pdserve.engine.sampler import TOP_P_CANDIDATES, _top_p_by_sort, top_p_filtered

TEXT = (
    "The history of the city begins in the early middle ages, when a small group of "
    "fishermen settled on the northern bank of the river and built a wooden church. Over the "
    "next three centuries the settlement grew into a market town"
)
SETTINGS = [(0.7, 0.8), (0.8, 0.95), (1.0, 0.9), (1.0, 0.99)]  # (temperature, top_p)


def model_logits(rows: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare_default_model(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, -rows:]
    with torch.inference_mode():
        return model(ids).logits[0].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="sequences in the step")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    logits = model_logits(args.rows)
    print(f"{args.rows} rows of {logits.shape[1]} logits, {torch.get_num_threads()} threads")
    print(
        "| temperature | top_p | rows past the candidates | sort ms | candidates first ms | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for temperature, top_p in SETTINGS:
        x = logits / temperature
        p = torch.full((args.rows,), top_p)
        assert torch.equal(top_p_filtered(x, p).isinf(), _top_p_by_sort(x, p).isinf())
        nucleus = (torch.softmax(x, -1).sort(-1, descending=True).values.cumsum(-1) < top_p).sum(-1)
        past = int((nucleus >= TOP_P_CANDIDATES).sum())
        sort_t, new_t = [], []
        for _ in range(3):  # interleaved rounds
            sort_t.append(median_ms(lambda x=x, p=p: _top_p_by_sort(x, p), args.repeats // 3))
            new_t.append(median_ms(lambda x=x, p=p: top_p_filtered(x, p), args.repeats // 3))
        s, n = statistics.median(sort_t), statistics.median(new_t)
        print(
            f"| {temperature} | {top_p} | {past} of {args.rows} | {s:.1f} | {n:.1f} | {s / n:.1f}x |"
        )


if __name__ == "__main__":
    main()
