"""Engine throughput against transformers' `generate` with static batching, side by side.

Same 64 prompts (random token ids, 128 tokens +/- 25%), 128 output tokens each
(EOS ignored), same dtype, same threads. pdserve's engine runs with up to
--concurrency requests at once (continuous batching); transformers runs static
batches of --concurrency (left-padded). Repeats alternate the two and report
medians. Writes a JSON and, with --write-results, a section of bench/RESULTS.md.

    .venv/bin/python -m bench.engine.throughput --repeats 3 --write-results
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import ROOT
from bench.results_md import machine, replace_section
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.prepare_model import resolve_model
from pdserve.testing.reference import left_padded


def make_prompts(n: int, mean_len: int, ratio: float, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = int(mean_len * (1 - ratio)), int(mean_len * (1 + ratio))
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def build_engine(path: Path, dtype: str, concurrency: int, max_num_batched_tokens: int) -> LLM:
    """The engine as this benchmark runs it: up to `concurrency` sequences a step."""
    return LLM(
        model=str(path),
        dtype=dtype,
        max_num_seqs=concurrency,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=1024,
        kv_cache_memory="2GiB",
    )


def run_engine(llm: LLM, prompts: list[list[int]], out_len: int) -> float:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == out_len for o in outs)
    return dt


def run_transformers(
    model, prompts: list[list[int]], out_len: int, batch: int, pad_id: int
) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids, mask = left_padded(prompts[i : i + batch], pad_id)
        width = ids.shape[1]
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=out_len,
                do_sample=False,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == width + out_len
    return time.perf_counter() - t0


def side_by_side(
    llm: LLM, hf, prompts: list[list[int]], out_len: int, concurrency: int, repeats: int
) -> tuple[list[float], list[float]]:
    """Output tok/s of the engine and of transformers, each run `repeats` times, alternating
    (after one small warm-up run each: allocator, kernels)."""
    run_engine(llm, prompts[:4], 8)
    run_transformers(hf, prompts[:4], 8, 4, 0)
    total_out = len(prompts) * out_len
    eng_tps, hf_tps = [], []
    for r in range(repeats):
        llm.engine.pool.reset_prefix_cache()
        eng_tps.append(total_out / run_engine(llm, prompts, out_len))
        hf_tps.append(total_out / run_transformers(hf, prompts, out_len, concurrency, 0))
        print(
            f"repeat {r + 1}: pdserve {eng_tps[-1]:.1f} tok/s, transformers {hf_tps[-1]:.1f} tok/s",
            flush=True,
        )
    return eng_tps, hf_tps


def profile_engine(llm: LLM, prompts: list[list[int]], out_len: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    run_engine(llm, prompts, out_len)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
    return "\n".join(lines[start:])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="checkpoint dir (default: prepared SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench/out/engine_throughput.json"))
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    llm = build_engine(path, args.dtype, args.concurrency, args.max_num_batched_tokens)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None
    prompts = make_prompts(
        args.num_prompts, args.input_len, 0.25, llm.engine.model_config.vocab_size, 0
    )
    eng_tps, hf_tps = side_by_side(
        llm, hf, prompts, args.output_len, args.concurrency, args.repeats
    )
    llm.engine.pool.reset_prefix_cache()
    profile = "" if args.no_profile else profile_engine(llm, prompts, args.output_len)

    result = {
        "machine": f"{machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "model": path.name,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "concurrency": args.concurrency,
        "pdserve_tok_s": eng_tps,
        "transformers_tok_s": hf_tps,
        "pdserve_median": statistics.median(eng_tps),
        "transformers_median": statistics.median(hf_tps),
    }
    result["ratio"] = result["pdserve_median"] / result["transformers_median"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2))
    if profile:
        print(profile)
    if args.write_results:
        replace_section(
            ROOT / "bench/RESULTS.md",
            f"engine-throughput-{args.dtype}",
            _markdown(result, profile, args),
        )
    return 0


def _markdown(r: dict, profile: str, args) -> str:
    cmd = (
        f".venv/bin/python -m bench.engine.throughput --repeats {args.repeats} "
        f"--concurrency {args.concurrency} --dtype {args.dtype} --write-results"
    )
    rows = "\n".join(
        f"| {i + 1} | {a:.1f} | {b:.1f} | {a / b:.2f}x |"
        for i, (a, b) in enumerate(zip(r["pdserve_tok_s"], r["transformers_tok_s"], strict=True))
    )
    return f"""## Engine throughput vs transformers `generate`, {r["dtype"]}

Machine: {r["machine"]}. Model: {r["model"]}, {r["dtype"]}. Workload: {r["num_prompts"]} prompts of
random token ids, {r["input_len"]} tokens +/- 25%, {r["output_len"]} output tokens each (EOS ignored),
{r["concurrency"]} at once: pdserve's continuous batching (max-num-seqs {r["concurrency"]}) against
transformers' static batches of {r["concurrency"]} (left-padded). Same process, alternating runs.

Command: `{cmd}`

| run | pdserve output tok/s | transformers output tok/s | ratio |
|---|---|---|---|
{rows}
| **median** | **{r["pdserve_median"]:.1f}** | **{r["transformers_median"]:.1f}** | **{r["ratio"]:.2f}x** |

Where pdserve's time goes (cProfile of one run, by own time):

```
{profile}
```
"""


if __name__ == "__main__":
    sys.exit(main())
