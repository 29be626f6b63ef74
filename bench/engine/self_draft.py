"""SmolLM2 drafting for itself: the acceptance of truncated-layer self-drafts.

SmolLM2-135M is the only real model here, so its draft-model case is a self-draft: its
first N layers (``pdserve.engine.draft_model.write_layer_draft``). For each N, the
embedded engine (float32, greedy) generates a rewrite request and a chat request, with and
without the draft; the table gives the acceptance and the time against no speculation.
Writes bench/RESULTS.md's self-draft section.

    .venv/bin/python -m bench.engine.self_draft [--layers 4,10,20] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.results_md import replace_section
from pdserve.core.model import default_model_dir
from pdserve.core.sampling import SamplingParams
from pdserve.engine.draft_model import write_layer_draft
from pdserve.engine.llm import LLM

SECTION = "self-draft"
TEXT = (
    "The committee approved the annual budget after a long discussion. The river rebuilt "
    "the northern road as planned. Every student visited a quiet garden before the winter "
    "began. My neighbour replaced a broken clock without any help."
)
REQUESTS = {
    "rewrite": [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}],
    "chat": [{"role": "user", "content": "Write a short story about a robot who paints."}],
}
MAX_TOKENS = 96


def run(llm: LLM) -> dict[str, tuple[float, int, int, int]]:
    """Per request: (seconds, tokens, accepted drafts, drafts)."""
    llm.chat([REQUESTS["chat"]], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    out = {}
    for name, messages in REQUESTS.items():
        before = llm.stats()
        start = time.perf_counter()
        res = llm.chat([messages], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
        seconds = time.perf_counter() - start
        after = llm.stats()
        out[name] = (
            seconds,
            len(res.token_ids),
            after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
            after.spec_num_draft_tokens - before.spec_num_draft_tokens,
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="4,10,20")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    source = default_model_dir()
    engine = dict(dtype="float32", max_model_len=2048, kv_cache_memory="256MiB")
    base = run(LLM(**engine))
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-draft-") as tmp:
        for n in (int(x) for x in args.layers.split(",")):
            draft = write_layer_draft(source, Path(tmp) / f"draft-{n}", n)
            config = {
                "method": "draft_model",
                "model": str(draft),
                "num_speculative_tokens": args.num_speculative_tokens,
            }
            got = run(LLM(speculative_config=json.dumps(config), **engine))
            for name, (seconds, tokens, accepted, drafted) in got.items():
                rate = accepted / drafted if drafted else 0.0
                rows.append((n, name, rate, accepted, drafted, base[name][0] / seconds, tokens))
                print(f"{n} layers, {name}: acceptance {rate:.2f}, speed-up "
                      f"{base[name][0] / seconds:.2f}x", flush=True)  # fmt: skip
    lines = [
        "## SmolLM2 self-draft (issue 17)",
        "",
        "The draft-model proposer with SmolLM2's first N of 30 layers as the draft (its own "
        f"embeddings, final norm and head), {args.num_speculative_tokens} tokens per step, "
        f"the embedded engine, float32, greedy, {MAX_TOKENS} tokens; speed-up: time without "
        "speculation over time with it (one request at a time).",
        "",
        "| draft layers | request | acceptance rate | accepted / proposed | speed-up |",
        "|---|---|---|---|---|",
    ]
    for n, name, rate, accepted, drafted, speedup, _ in rows:
        lines.append(f"| {n} | {name} | {rate:.2f} | {accepted} / {drafted} | {speedup:.2f}x |")
    lines += [
        "",
        "A truncated model is a poor draft: its last layer's output was never trained to "
        "feed the final norm and head, so its greedy tokens seldom agree with the full "
        "model's. A trained small model with the same tokenizer (e.g. a distilled one) is "
        "the draft to use; none is installable here.",
        "",
        f"Command: `.venv/bin/python -m bench.engine.self_draft --layers {args.layers} --write-results`",
    ]
    body = "\n".join(lines)
    print(body)
    if args.write_results:
        replace_section(ROOT / "bench/RESULTS.md", SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
