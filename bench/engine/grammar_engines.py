"""xgrammar against llguidance on pdserve's structured-output workloads: what a grammar costs
to prepare, and what its token mask costs per generated token.

    .venv/bin/python -m bench.engine.grammar_engines [--repeats 5] [--write-results]

With SmolLM2-135M-Instruct's tokenizer (49,152 tokens), for each workload (the five Pydantic
schemas of the SDK test, a tool call's arguments, the any-JSON grammar, a regex, a choice,
and a regex whose automaton is large): the time to compile (xgrammar's compiler, caching off)
or to build a matcher and compute its first mask (llguidance, which compiles lazily), and the
median time of one step along a valid output (fill the next-token bitmask, accept the token).
Both engines run in this process, one after the other, on the same tokens (llguidance is
not a pdserve dependency: `pip install llguidance` to run this).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench import ROOT
from bench.results_md import machine, replace_section
from pdserve.core.sampling import StructuredOutputs
from pdserve.engine.prepare_model import prepare_default_model
from pdserve.engine.structured_output import compile_spec
from pdserve.testing.schemas import SAMPLE_OUTPUTS, SCHEMAS

VOCAB = 49152


def workloads() -> list[tuple[str, StructuredOutputs, str]]:
    """(name, constraint, a valid output)."""
    out = [
        (name, StructuredOutputs(json=json.dumps(s)), SAMPLE_OUTPUTS[name])
        for name, s in SCHEMAS.items()
    ]
    out.append(
        (
            "any JSON object",
            StructuredOutputs(json_object=True),
            json.dumps({"a": [1, 2, {"b": "c"}], "d": None}),
        )
    )
    out.append(("regex: a date", StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}"), "2026-12-06"))
    choices = ("positive", "negative", "neutral")
    out.append(("choice of 3", StructuredOutputs(choice=choices), "neutral"))
    out.append(("regex: [a-z]{1,2000}", StructuredOutputs(regex="[a-z]{1,2000}"), "abcdefghij" * 4))
    return out


def _xgrammar(tokenizer, items, repeats):
    """pdserve's own compile (``compile_spec``: the options the workers use)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    results = {}
    for name, spec, sample in items:
        compiles = []
        for _ in range(repeats):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            began = time.perf_counter()
            compiled = compile_spec(compiler, spec)
            compiles.append(time.perf_counter() - began)
        steps = []
        for _ in range(repeats):
            matcher = xgr.GrammarMatcher(compiled)
            for token in tokenizer.encode(sample, add_special_tokens=False):
                began = time.perf_counter()
                matcher.fill_next_token_bitmask(mask)
                ok = matcher.accept_token(token)
                steps.append(time.perf_counter() - began)
                assert ok, f"xgrammar refused a token of {name}'s sample"
        results[name] = (statistics.median(compiles), statistics.median(steps))
    return results


def _llguidance_grammar(spec: StructuredOutputs) -> str:
    from llguidance import LLMatcher

    if spec.json is not None:
        return LLMatcher.grammar_from_json_schema(spec.json)
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))


def _llguidance(tokenizer, items, repeats):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    mask = lln.allocate_token_bitmask(1, VOCAB)
    results = {}
    for name, spec, sample in items:
        text = _llguidance_grammar(spec)
        compiles, steps = [], []
        for _ in range(repeats):
            began = time.perf_counter()
            matcher = llguidance.LLMatcher(lltok, text)
            lln.fill_next_token_bitmask(matcher, mask)
            compiles.append(time.perf_counter() - began)
            assert not matcher.is_error(), matcher.get_error()
            for k, token in enumerate(tokenizer.encode(sample, add_special_tokens=False)):
                began = time.perf_counter()
                if k:  # the first mask is in the compile column
                    lln.fill_next_token_bitmask(matcher, mask)
                ok = matcher.consume_token(token)
                steps.append(time.perf_counter() - began)
                assert ok, f"llguidance refused a token of {name}'s sample: {matcher.get_error()}"
        results[name] = (statistics.median(compiles), statistics.median(steps))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model(progress=False))
    items = workloads()
    xgr = _xgrammar(tokenizer, items, args.repeats)
    llg = _llguidance(tokenizer, items, args.repeats)
    lines = [
        "| workload | xgrammar compile ms | llguidance first mask ms | xgrammar µs/token "
        "| llguidance µs/token |",
        "|---|---|---|---|---|",
    ]
    for name, *_ in items:
        (xc, xs), (lc, ls) = xgr[name], llg[name]
        lines.append(
            f"| {name} | {xc * 1e3:.1f} | {lc * 1e3:.1f} | {xs * 1e6:.1f} | {ls * 1e6:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.write_results:
        import importlib.metadata as md

        body = (
            "## Grammar engines for structured outputs (issue 36)\n\n"
            f"Machine: {machine()}. xgrammar {md.version('xgrammar')}, llguidance "
            f"{md.version('llguidance')}, SmolLM2-135M-Instruct's tokenizer; medians of "
            f"{args.repeats} runs (`python -m bench.engine.grammar_engines --write-results`). "
            "Compile: xgrammar's compiler with its cache off; llguidance compiles lazily, so "
            "its column is a new matcher and its first mask. Per token: fill the bitmask and "
            "accept the token, along a valid output.\n\n" + table
        )
        replace_section(ROOT / "bench" / "RESULTS.md", "grammar-engines", body)


if __name__ == "__main__":
    main()
