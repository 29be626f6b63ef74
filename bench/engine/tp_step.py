"""Engine step times at tensor-parallel sizes side by side: decode steps at batch sizes and
one prefill, on a random Llama-shaped model sized by ``--shape``.

    .venv/bin/python -m bench.engine.tp_step [--tp 1 2] [--shape llama-250m]
        [--batches 1 8] [--device cpu] [--dtype float32] [--eager] [--rounds 3]

Each (round, TP size) is one engine in this process, built, warmed up and closed in turn
(alternating sizes across rounds); a decode figure is the median time of the last 40 of
48 decode steps for B prompts of 256 tokens (context 256-304), a prefill figure the time
of one step over a 512-token prompt; the table gives each size's median over the rounds,
and the ratio to the first size.

On a 2-core CPU the ranks share the two cores (each rank one thread at TP 2, two threads
at TP 1), and every layer adds two gloo all-reduces over loopback: expect TP 2 to be
slower there. The figure that matters is on GPUs (``--device cuda``, one GPU per rank,
``--shape llama-8b`` for an 8B model's shape): TPOT at TP 1/2/4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    # ~250M parameters: 16 heads, 4 KV heads; fits a small CPU.
    "llama-250m": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    # Llama-3-8B's shape (random weights).
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}


def build_checkpoint(path: Path, shape: str, dtype: str) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pdserve.testing.tiny_models import build_tiny_tokenizer

    config = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=4096,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def measure(engine, batches: list[int], first: int) -> dict[str, float]:
    from pdserve.core.sampling import SamplingParams

    out = {}
    params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0)
    for b in batches:
        for i in range(b):  # distinct prompts: no prefix-cache hits
            engine.add_request(list(range(first + 300 * i, first + 300 * i + 256)), params)
        times = []
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        out[f"decode b{b} ms"] = statistics.median(times[-40:]) * 1000
        first += 300 * b
    engine.add_request(list(range(first, first + 512)), SamplingParams(max_tokens=1))
    started = time.perf_counter()
    engine.step()
    out["prefill 512 ms"] = (time.perf_counter() - started) * 1000
    while engine.has_unfinished():
        engine.step()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-250m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true", help="no compile / CUDA graphs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from pdserve.engine import LLM

    path = build_checkpoint(Path(tempfile.mkdtemp()), args.shape, args.dtype)
    figures: dict[int, list[dict[str, float]]] = {tp: [] for tp in args.tp}
    first = 3
    for r in range(args.rounds):
        order = args.tp if r % 2 == 0 else list(reversed(args.tp))
        for tp in order:
            llm = LLM(
                model=str(path),
                dtype=args.dtype,
                device=args.device,
                tensor_parallel_size=tp,
                enforce_eager=args.eager,
                kv_cache_memory="512MiB",
                max_model_len=2048,
            )
            measure(llm.engine, [1], 30000)  # warm-up (compile, first steps)
            figures[tp].append(measure(llm.engine, args.batches, first))
            first += 300 * sum(args.batches) + 600
            llm.engine.close()
            del llm
    names = list(figures[args.tp[0]][0])
    medians = {
        tp: {n: statistics.median(f[n] for f in figures[tp]) for n in names} for tp in args.tp
    }
    base = args.tp[0]
    print(f"shape {args.shape}, {args.dtype}, {args.device}, median of {args.rounds} rounds")
    print(
        f"{'':16}"
        + "".join(f"{'TP ' + str(tp):>12}" for tp in args.tp)
        + "   ratio to TP "
        + str(base)
    )
    for n in names:
        ratios = ", ".join(f"{medians[tp][n] / medians[base][n]:.2f}x" for tp in args.tp[1:])
        print(f"{n:16}" + "".join(f"{medians[tp][n]:12.1f}" for tp in args.tp) + f"   {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
