"""The CUDA-graph decode path on a GPU: exactness with graphs on, and TPOT graphs vs eager.

    python -m bench.gpu.cuda_graphs [--out DIR] [--write-results] [--skip-tests]
                                    [--model default|random-smollm2|PATH]

1. Runs the exactness tests (tiny Llama/Qwen2 and SmolLM2 against transformers, fp32
   greedy, near-tie rule) on the GPU, where an engine that is not ``--enforce-eager``
   replays a CUDA graph per decode bucket; their output goes to ``DIR/exactness.txt``.
2. Times decode steps of SmolLM2-135M (bf16, 256-token contexts) at batch 1, 16 and 64,
   with CUDA graphs and with ``--enforce-eager``, in one process, alternating, and
   reports the medians (TPOT = one decode step per token of each sequence).
   ``--model random-smollm2`` times SmolLM2-135M's architecture with random weights
   (the same work per step, no GGUF file needed).

Writes ``DIR/cuda_graphs.json`` (DIR: ``$OUT`` or bench/out). Exit codes: 0 done, 1 the
tests failed, 2 no CUDA device. ``--device cpu`` runs the timing on the CPU (eager both
sides): a dry run of the script itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import ROOT
from bench.results_md import replace_section
from pdserve.engine import LLM, SamplingParams

BATCHES = (1, 16, 64)
CONTEXT = 256
STEPS = 30
# SmolLM2-135M-Instruct's architecture (its config.json), for --model random-smollm2.
SMOLLM2_CONFIG = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)


def random_smollm2(path: Path) -> Path:
    """A bf16 checkpoint of SmolLM2-135M's architecture with random weights, at ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pdserve.testing.tiny_models import build_tiny_tokenizer

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**SMOLLM2_CONFIG), dtype=torch.bfloat16
        )
        model.save_pretrained(path)
        build_tiny_tokenizer().save_pretrained(path)
    return path


def resolve_bench_model(name: str) -> str | None:
    """The ``model`` argument of ``LLM`` for ``--model``."""
    if name == "default":
        return None
    if name == "random-smollm2":
        return str(random_smollm2(Path(tempfile.gettempdir()) / "pdserve-random-smollm2"))
    return name


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_step_ms(llm: LLM, batch: int, device: str, steps: int = STEPS) -> float:
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
        _sync(device)
        started = time.perf_counter()
        llm.engine.step()
        _sync(device)
        if decoding:
            times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) * 1e3


MODEL_NAMES = {
    "default": "SmolLM2-135M-Instruct",
    "random-smollm2": "SmolLM2-135M's architecture with random weights",
}


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
    ap.add_argument(
        "--model",
        default="default",
        help="default (SmolLM2-135M-Instruct), random-smollm2 (its architecture, random "
        "weights) or a checkpoint directory",
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument(
        "--batches", default=",".join(map(str, BATCHES)), help="decode batch sizes, e.g. 1,16,64"
    )
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    # The engines' start-up lines: graph capture time and memory, KV blocks.
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tests_rc = 0 if args.skip_tests else run_tests(out)
    model = resolve_bench_model(args.model)
    common = dict(
        dtype="bfloat16",
        device=args.device,
        max_num_seqs=max(batches),
        kv_cache_memory="4GiB" if args.device == "cuda" else "1GiB",
    )
    # On the CPU (a dry run) both engines are eager: "graphs" there is only a name.
    engines = {
        "graphs": LLM(model=model, enforce_eager=args.device == "cpu", **common),
        "eager": LLM(model=model, enforce_eager=True, **common),
    }
    if args.device == "cuda" and engines["graphs"].engine.runner.mode != "cuda-graphs":
        print(f"expected CUDA graphs, got {engines['graphs'].engine.runner.mode}")
        return 1
    rows = []
    for batch in batches:
        ms = {name: [] for name in engines}
        for _ in range(3):  # alternate, medians of 3
            for name, llm in engines.items():
                ms[name].append(decode_step_ms(llm, batch, args.device))
        row = {name: statistics.median(v) for name, v in ms.items()}
        row["batch"] = batch
        rows.append(row)
        print(f"batch {batch}: graphs {row['graphs']:.2f} ms, eager {row['eager']:.2f} ms")
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": args.model,
        "torch": torch.__version__,
        "tests_passed": None if args.skip_tests else tests_rc == 0,
        "tpot_ms": rows,
    }
    (out / "cuda_graphs.json").write_text(json.dumps(result, indent=1))
    if args.write_results:
        lines = [
            "## CUDA graphs on a GPU",
            "",
            f"Device: {result['device']}, torch {result['torch']}. {MODEL_NAMES.get(args.model, args.model)}, bf16, "
            f"{CONTEXT}-token contexts; decode step (TPOT) medians of 3 alternating runs of "
            f"{STEPS} steps. Exactness tests with graphs on: "
            f"{'not run' if args.skip_tests else 'passed' if tests_rc == 0 else 'FAILED'}.",
            "",
            "| batch | CUDA graphs ms | eager ms | speed-up |",
            "|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['batch']} | {r['graphs']:.2f} | {r['eager']:.2f} | "
                f"{r['eager'] / r['graphs']:.2f}x |"
            )
        lines += ["", "Command: `python -m bench.gpu.cuda_graphs --write-results`"]
        replace_section(ROOT / "bench/RESULTS.md", "cuda-graphs-gpu", "\n".join(lines))
    return 0 if tests_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
