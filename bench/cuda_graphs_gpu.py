"""The CUDA-graph decode path on a GPU: exactness with graphs on, and TPOT graphs vs eager.

    python bench/cuda_graphs_gpu.py [--out DIR] [--write-results] [--skip-tests]

1. Runs the exactness tests (tiny Llama/Qwen2 and SmolLM2 against transformers, fp32
   greedy, near-tie rule) on the GPU, where an engine that is not ``--enforce-eager``
   replays a CUDA graph per decode bucket; their output goes to ``DIR/exactness.txt``.
2. Times decode steps of SmolLM2-135M (bf16, 256-token contexts) at batch 1, 16 and 64,
   with CUDA graphs and with ``--enforce-eager``, in one process, alternating, and
   reports the medians (TPOT = one decode step per token of each sequence).

Writes ``DIR/cuda_graphs.json`` (DIR: ``$OUT`` or bench/out). Exit codes: 0 done, 1 the
tests failed, 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results_md import replace_section  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402

BATCHES = (1, 16, 64)
CONTEXT = 256
STEPS = 30


def decode_step_ms(llm: LLM, batch: int, steps: int = STEPS) -> float:
    """Median wall time of a decode step with ``batch`` sequences at ~CONTEXT tokens."""
    rng = random.Random(batch)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for _ in range(batch):
        llm.engine.add_request([rng.randrange(vocab) for _ in range(CONTEXT)], params)
    times = []
    while llm.engine.has_unfinished():
        decoding = not llm.engine.scheduler.waiting and all(
            s.num_output_tokens for s in llm.engine.scheduler.running
        )
        torch.cuda.synchronize()
        started = time.perf_counter()
        llm.engine.step()
        torch.cuda.synchronize()
        if decoding:
            times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) * 1e3


def run_tests(out: Path) -> int:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "tests/integration/test_exactness_tiny.py",
        "tests/integration/test_exactness_smollm2.py",
        "tests/integration/test_decode_padding.py",
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "exactness.txt").write_text(result.stdout + result.stderr)
    print(result.stdout[-2000:])
    return result.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench/out")))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tests_rc = 0 if args.skip_tests else run_tests(out)
    common = dict(dtype="bfloat16", max_num_seqs=max(BATCHES), kv_cache_memory="4GiB")
    engines = {
        "graphs": LLM(model=None, **common),
        "eager": LLM(model=None, enforce_eager=True, **common),
    }
    assert engines["graphs"].engine.runner.mode == "cuda-graphs"
    rows = []
    for batch in BATCHES:
        ms = {name: [] for name in engines}
        for _ in range(3):  # alternate, medians of 3
            for name, llm in engines.items():
                ms[name].append(decode_step_ms(llm, batch))
        row = {name: statistics.median(v) for name, v in ms.items()}
        row["batch"] = batch
        rows.append(row)
        print(f"batch {batch}: graphs {row['graphs']:.2f} ms, eager {row['eager']:.2f} ms")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tests_passed": tests_rc == 0,
        "tpot_ms": rows,
    }
    (out / "cuda_graphs.json").write_text(json.dumps(result, indent=1))
    if args.write_results:
        lines = [
            "## CUDA graphs on a GPU",
            "",
            f"Device: {result['device']}, torch {result['torch']}. SmolLM2-135M-Instruct, bf16, "
            f"{CONTEXT}-token contexts; decode step (TPOT) medians of 3 alternating runs of "
            f"{STEPS} steps. Exactness tests with graphs on: "
            f"{'passed' if tests_rc == 0 else 'FAILED'}.",
            "",
            "| batch | CUDA graphs ms | eager ms | speed-up |",
            "|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['batch']} | {r['graphs']:.2f} | {r['eager']:.2f} | "
                f"{r['eager'] / r['graphs']:.2f}x |"
            )
        lines += ["", "Command: `python bench/cuda_graphs_gpu.py --write-results`"]
        replace_section(ROOT / "bench/RESULTS.md", "cuda-graphs-gpu", "\n".join(lines))
    return 0 if tests_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
