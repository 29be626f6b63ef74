"""The fastest any engine could run bench.engine.throughput's workload here: its GEMMs at this CPU's best rate.

Counts the floating-point work the workload cannot avoid (every prompt token through
every layer's linears, every decoded token through the linears and lm_head, and
causal attention over each token's context), times this machine's best float32
matrix multiply over a range of shapes (the model's own at decode and prefill row
counts, and large square ones), and runs pdserve's engine and transformers' static
batching on the same prompts, alternating. The work divided by the best rate is a floor
on any engine's time, whatever its software; transformers' time divided by that floor
is the largest speed-up over transformers that this machine allows.

    .venv/bin/python -m bench.kernels.gemm_ceiling --repeats 3 --write-results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import ROOT
from bench.engine.throughput import (
    build_engine,
    make_prompts,
    side_by_side,
)
from bench.results_md import machine, replace_section
from pdserve.engine.prepare_model import resolve_model
from pdserve.kernels import sgemm_cpu


@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg) -> Shapes:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            cfg.vocab_size,
        )

    def linears(self) -> list[tuple[int, int]]:
        """One layer's weights as (K, N): q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def layer_flops(self) -> int:
        """Linear FLOPs of one token through every layer."""
        return self.layers * sum(2 * k * n for k, n in self.linears())

    def head_flops(self) -> int:
        return 2 * self.hidden * self.vocab

    def attention_flops(self, context: int) -> int:
        """QK^T and PV of one token over `context` positions, every layer."""
        return self.layers * 4 * self.heads * self.head_dim * context


def workload_flops(shapes: Shapes, prompt_lens: list[int], out_len: int) -> dict[str, int]:
    """The work every engine does: prefill the prompt (lm_head on its last token only),
    then out_len - 1 single-token steps (the last sampled token is never fed back)."""
    linear = attention = 0
    for n in prompt_lens:
        linear += n * shapes.layer_flops() + shapes.head_flops()
        attention += sum(shapes.attention_flops(c) for c in range(1, n + 1))
        steps = out_len - 1
        linear += steps * (shapes.layer_flops() + shapes.head_flops())
        attention += sum(shapes.attention_flops(n + 1 + s) for s in range(steps))
    return {"linear": linear, "attention": attention}


def gemm_rate(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """GFLOP/s of the fastest float32 [m, k] x [k, n] here, warm operands: the best of
    `torch.mm`, `F.linear`, oneDNN's prepacked linear and, where it is built, pdserve's
    sgemm kernel, each the best of 3 timed bursts."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    wt = w.t().contiguous()
    calls = {"mm": lambda: torch.mm(x, wt), "linear": lambda: torch.nn.functional.linear(x, w)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        calls["packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        )
    if sgemm_cpu.available() and sgemm_cpu.supports(w):
        panels = sgemm_cpu.pack(w)
        calls["sgemm"] = lambda: sgemm_cpu.linear(x, panels, None, n)
    return max(2 * m * k * n / _best_time(f, seconds) / 1e9 for f in calls.values())


def _best_time(f, seconds: float) -> float:
    f()
    t0 = time.perf_counter()
    f()
    calls = max(1, int(seconds / max(1e-5, time.perf_counter() - t0)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def fused(shapes: Shapes) -> list[tuple[int, int]]:
    """The fused weights an engine may use instead: q|k|v and gate|up."""
    q, kv = shapes.heads * shapes.head_dim, shapes.kv_heads * shapes.head_dim
    return [(shapes.hidden, q + 2 * kv), (shapes.hidden, 2 * shapes.intermediate)]


def shaped_floor(
    shapes: Shapes, prompt_lens: list[int], out_len: int, rows: dict[str, float], decode_m: int
) -> float:
    """Seconds of linears when each weight runs at the rate measured for its own shape
    (fused or not, whichever is faster): prompt tokens in 512-row chunks, decode steps
    of `decode_m` rows."""

    def t(m: int, k: int, n: int) -> float:
        return 2 * m * k * n / (rows[f"{m}x{k}x{n}"] * 1e9)

    def layer(m: int) -> float:
        (qk, qn), (kk, kn), _, (ok, on), (gk, gn), _, (dk, dn) = shapes.linears()
        (fk, fn), (uk, un) = fused(shapes)
        attn_in = min(t(m, qk, qn) + 2 * t(m, kk, kn), t(m, fk, fn))
        mlp_in = min(2 * t(m, gk, gn), t(m, uk, un))
        return shapes.layers * (attn_in + t(m, ok, on) + mlp_in + t(m, dk, dn))

    head = t(decode_m, shapes.hidden, shapes.vocab)
    prompt_tokens, steps = sum(prompt_lens), len(prompt_lens) * (out_len - 1)
    prefill = prompt_tokens / 512 * layer(512) + len(prompt_lens) / decode_m * head
    return prefill + steps / decode_m * (layer(decode_m) + head)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2-135M)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each engine (medians)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench/out/gemm_ceiling.json"))
    ap.add_argument("--write-results", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model(args.model)
    shapes = Shapes.from_config(AutoConfig.from_pretrained(path))
    prompts = make_prompts(args.num_prompts, args.input_len, 0.25, shapes.vocab, 0)
    flops = workload_flops(shapes, [len(p) for p in prompts], args.output_len)

    rows = {}
    for m in (args.concurrency, 512):
        for k, n in sorted(set(shapes.linears() + fused(shapes))) + [(shapes.hidden, shapes.vocab)]:
            rows[f"{m}x{k}x{n}"] = gemm_rate(m, k, n)
    for s in (1024, 2048, 3072):
        rows[f"{s}x{s}x{s}"] = gemm_rate(s, s, s)
    best_shape = max(rows, key=rows.get)
    best = rows[best_shape]
    shaped_s = shaped_floor(
        shapes, [len(p) for p in prompts], args.output_len, rows, args.concurrency
    )

    llm = build_engine(path, "float32", args.concurrency, args.max_num_batched_tokens)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    total_out = args.num_prompts * args.output_len
    eng_tps, hf_tps = side_by_side(
        llm, hf, prompts, args.output_len, args.concurrency, args.repeats
    )
    hf_median = statistics.median(hf_tps)

    floor_s = (flops["linear"] + flops["attention"]) / (best * 1e9)
    result = {
        "machine": machine(),
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads",
        "model": path.name,
        "workload": f"{args.num_prompts} prompts, {args.input_len} +/- 25% -> {args.output_len}",
        "gflop": {k: v / 1e9 for k, v in flops.items()},
        "gemm_gflop_s": rows,
        "best_shape": best_shape,
        "best_gflop_s": best,
        "floor_s": floor_s,
        "max_tok_s": total_out / floor_s,
        "transformers_tok_s": hf_tps,
        "transformers_median": hf_median,
        "max_ratio": total_out / floor_s / hf_median,
        "shaped_floor_s": shaped_s,
        "shaped_max_tok_s": total_out / shaped_s,
        "shaped_max_ratio": total_out / shaped_s / hf_median,
        "pdserve_tok_s": eng_tps,
        "pdserve_median": statistics.median(eng_tps),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if args.write_results:
        replace_section(ROOT / "bench/RESULTS.md", "gemm-ceiling", _markdown(result, args))
    return 0


def _markdown(r: dict, args) -> str:
    rates = "\n".join(f"| {s} | {v:.0f} |" for s, v in r["gemm_gflop_s"].items())
    runs = ", ".join(
        f"{a:.1f} / {b:.1f}"
        for a, b in zip(r["pdserve_tok_s"], r["transformers_tok_s"], strict=True)
    )
    p, hf = r["pdserve_median"], r["transformers_median"]
    return f"""## How fast any engine could be here: the GEMM floor (issue 13)

Machine: {r["machine"]}, torch {r["torch"]}. Model: {r["model"]}, float32. Workload:
bench.engine.throughput's ({r["workload"]}, {args.concurrency} at once).

The work no engine can skip: {r["gflop"]["linear"]:.0f} GFLOP of linears (prompt tokens through every
layer, lm_head on each prompt's last token and on each decoded token) and
{r["gflop"]["attention"]:.0f} GFLOP of causal attention. This machine's float32 matrix multiply
(the best of `torch.mm`, `F.linear`, oneDNN's prepacked linear and, where it is built,
pdserve's sgemm kernel; warm operands, best of 3 bursts), GFLOP/s:

| m x k x n | GFLOP/s |
|---|---|
{rates}

| | output tok/s | x transformers |
|---|---|---|
| transformers' static batching (median of {len(r["transformers_tok_s"])}) | {hf:.1f} | 1.00x |
| pdserve's engine (median of {len(r["pdserve_tok_s"])}, alternating with transformers) | {p:.1f} | {p / hf:.2f}x |
| linears at the rates of their own shapes ({args.concurrency}-row decode steps, 512-row prefill chunks, fused or not), nothing else: {r["shaped_floor_s"]:.1f} s | {r["shaped_max_tok_s"]:.0f} | {r["shaped_max_ratio"]:.2f}x |
| all the work at the best rate above ({r["best_gflop_s"]:.0f} GFLOP/s, {r["best_shape"]}), nothing else: {r["floor_s"]:.1f} s | {r["max_tok_s"]:.0f} | {r["max_ratio"]:.2f}x |

Runs, pdserve / transformers tok/s: {runs}.

The last two rows are floors on any engine's time on this machine, whatever its
software: no memory traffic, attention kernel, sampling or scheduling counted. pdserve
runs at {p / r["shaped_max_tok_s"]:.0%} of the shaped floor's speed.

Command: `.venv/bin/python -m bench.kernels.gemm_ceiling --repeats {args.repeats} --write-results`
"""


if __name__ == "__main__":
    sys.exit(main())
