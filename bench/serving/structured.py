"""Structured outputs served, end to end: the openai SDK's ``parse`` of five Pydantic schemas
against `pdserve up` (disaggregated), with speculation off and on; and what a JSON schema
costs at 16 concurrent requests, against the same requests unconstrained.

    .venv/bin/python -m bench.serving.structured [--prompts 20] [--rounds 2] [--write-results]

For each cluster (`pdserve up --prefill 1 --decode 1`, dtype auto; then again with n-gram
speculation on its decode worker):

- parse: each schema of ``pdserve.testing.schemas`` with ``--prompts`` prompts (its question
  about each subject), greedy, 16 at a time: how many ``message.parsed`` objects came back;
- cost (speculation off): 64 chat requests under their JSON schema (``response_format``
  json_schema), 16 at a time; then the same prompts unconstrained, each with max_tokens the
  length its constrained answer had and EOS ignored, so both runs generate the same number
  of tokens. The two alternate for ``--rounds``; output tok/s medians and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import openai

from bench import ROOT
from bench.results_md import machine, replace_section
from bench.serving.compare import System, _pdserve_up
from pdserve.engine.prepare_model import prepare_default_model
from pdserve.local.launcher import Launcher
from pdserve.testing.schemas import MODELS, PROMPTS, SUBJECTS

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
CONCURRENCY = 16
COST_REQUESTS = 64


def questions(per_schema: int) -> list[tuple[str, str]]:
    """(schema name, question) pairs: each schema about its first ``per_schema`` subjects."""
    return [
        (name, PROMPTS[name].format(subject=SUBJECTS[k % len(SUBJECTS)]))
        for name in MODELS
        for k in range(per_schema)
    ]


async def _bounded(calls, limit: int = CONCURRENCY):
    semaphore = asyncio.Semaphore(limit)

    async def run(call):
        async with semaphore:
            return await call()

    return await asyncio.gather(*(run(c) for c in calls))


async def parse_all(client: openai.AsyncOpenAI, model: str, per_schema: int) -> dict[str, int]:
    """Per schema: how many of its questions came back as a parsed object."""

    async def ask(name: str, question: str):
        completion = await client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": question}],
            response_format=MODELS[name],
            temperature=0,
        )
        return name, isinstance(completion.choices[0].message.parsed, MODELS[name])

    results = await _bounded([lambda n=n, q=q: ask(n, q) for n, q in questions(per_schema)])
    counts = dict.fromkeys(MODELS, 0)
    for name, ok in results:
        counts[name] += ok
    return counts


def _schema_format(name: str) -> dict:
    schema = MODELS[name].model_json_schema()
    return {
        "type": "json_schema",
        "json_schema": {"name": name.replace(" ", "_"), "schema": schema},
    }


async def constrained_run(client, model: str, items) -> tuple[float, list[int]]:
    """(output tok/s, each answer's token count) of the items under their schemas."""

    async def ask(name: str, question: str):
        r = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            response_format=_schema_format(name),
            temperature=0,
        )
        return r.usage.completion_tokens

    began = time.perf_counter()
    counts = await _bounded([lambda n=n, q=q: ask(n, q) for n, q in items])
    return sum(counts) / (time.perf_counter() - began), counts


async def free_run(client, model: str, items, lengths: list[int]) -> float:
    """Output tok/s of the same items unconstrained, each exactly its length."""

    async def ask(question: str, n: int):
        r = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=n,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    began = time.perf_counter()
    counts = await _bounded(
        [lambda q=q, n=n: ask(q, n) for (_, q), n in zip(items, lengths, strict=True)]
    )
    return sum(counts) / (time.perf_counter() - began)


async def phases(url: str, model: str, args, cost: bool) -> dict:
    """The parse phase, and with ``cost`` the cost phase, on one client and event loop."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=600, max_retries=0)
    async with client:
        out: dict = {}
        began = time.perf_counter()
        out["parsed"] = await parse_all(client, model, args.prompts)
        out["parse_s"] = time.perf_counter() - began
        print("parsed", out["parsed"], f"in {out['parse_s']:.0f} s", flush=True)
        if cost:
            items = [questions(COST_REQUESTS // len(MODELS) + 1)[k] for k in range(COST_REQUESTS)]
            _, lengths = await constrained_run(client, model, items)  # a warm-up round
            json_rates, free_rates = [], []
            for _ in range(args.rounds):
                rate, lengths = await constrained_run(client, model, items)
                json_rates.append(rate)
                free_rates.append(await free_run(client, model, items, lengths))
                print("json", json_rates[-1], "free", free_rates[-1], flush=True)
            out["json_tok_s"], out["free_tok_s"] = json_rates, free_rates
        return out


def run_cluster(model_dir: Path, extra: list[str], args, log_dir: Path) -> dict:
    system = System("up", Launcher(log_dir, cwd=ROOT))
    try:
        pools = ["--prefill", "1", "--decode", "1", *extra]
        url = _pdserve_up(system, model_dir, args.startup_timeout, pools)
        return asyncio.run(phases(url, model_dir.name, args, cost=not extra))
    finally:
        system.stop()


def report(results: dict, args) -> str:
    lines = ["| speculation | schema | parsed |", "|---|---|---|"]
    for mode, r in results.items():
        for name, ok in r["parsed"].items():
            lines.append(f"| {mode} | {name} | {ok}/{args.prompts} |")
    cost = results["off"]
    j, f = statistics.median(cost["json_tok_s"]), statistics.median(cost["free_tok_s"])
    lines += [
        "",
        f"Cost at c{CONCURRENCY}, {COST_REQUESTS} requests, medians of {args.rounds} rounds: "
        f"json_schema {j:.1f} output tok/s, the same requests unconstrained {f:.1f} "
        f"(ratio {j / f:.3f}); rounds: json {[round(x, 1) for x in cost['json_tok_s']]}, "
        f"free {[round(x, 1) for x in cost['free_tok_s']]}.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20, help="questions per schema")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    model = prepare_default_model(progress=False)
    out = ROOT / "bench/out/structured"
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "off": run_cluster(model, [], args, out / "off"),
        "n-gram": run_cluster(model, ["--speculative-config", NGRAM], args, out / "ngram"),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = report(results, args)
    print(table)
    if args.write_results:
        body = (
            "## Structured outputs served (issue 36)\n\n"
            f"Machine: {machine()}. `pdserve up --prefill 1 --decode 1` (dtype auto), "
            "SmolLM2-135M-Instruct, the openai SDK (`python -m bench.serving.structured "
            f"--prompts {args.prompts} --rounds {args.rounds} --write-results`).\n\n" + table
        )
        replace_section(ROOT / "bench" / "RESULTS.md", "structured-outputs", body)


if __name__ == "__main__":
    main()
