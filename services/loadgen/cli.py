"""`pdserve bench`: benchmark any OpenAI-compatible server with vLLM's serving metrics.

    pdserve bench serve --base-url http://127.0.0.1:8000 --model NAME --workload random \\
        --random-input-len 512 --random-output-len 128 --num-prompts 200 \\
        --request-rate 4 --max-concurrency 32 --goodput ttft:500 tpot:50 --result-file r.json
    pdserve bench sweep ... --concurrencies 1,4,16 --result-file sweep.json
    pdserve bench plot r.json sweep.json --out plots/

The result files' schema is in pdserve.loadgen.report. The flags of `vllm bench serve` work too, so
a vLLM user's command line runs unchanged: --dataset-name (random, custom = jsonl, or any
workload above), --host/--port (instead of --base-url), --backend (openai-chat: the chat
endpoint), --endpoint /v1/completions, --result-filename, --save-result, --result-dir and
--ignore-eos (the default here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from pdserve.loadgen.client import ENDPOINTS, ClientConfig, RunResult, num_requests, run_sessions
from pdserve.loadgen.metrics import SLO_KINDS, BenchmarkMetrics, compute_metrics
from pdserve.loadgen.report import serve_result, summary, sweep_result, write_result
from pdserve.loadgen.workloads import (
    WORKLOADS,
    Session,
    WorkloadParams,
    build_workload,
    load_tokenizer,
)

_PROG = "pdserve bench"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Benchmark an OpenAI-compatible server (pdserve, vLLM, ...) with the "
        "metrics of `vllm bench serve`: TTFT, TPOT, ITL, E2EL, throughput and goodput.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,sweep,plot}")
    serve = sub.add_parser("serve", help="run one workload and report its metrics")
    _add_run_args(serve)
    serve.add_argument(
        "--max-concurrency",
        type=_positive_int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    serve.set_defaults(func=_cmd_serve)

    sweep = sub.add_parser("sweep", help="run the same workload at several concurrencies")
    _add_run_args(sweep)
    sweep.add_argument(
        "--concurrencies",
        type=_int_list,
        required=True,
        help="comma-separated maximum concurrencies, one run each, e.g. 1,4,16",
    )
    sweep.add_argument(
        "--prompts-per-concurrency",
        type=int,
        default=None,
        metavar="K",
        help="at concurrency c send only the first min(num_prompts, K*c) prompts of the "
        "workload (low concurrencies take long; the prompts stay the same ones); "
        "default: all at every concurrency",
    )
    sweep.set_defaults(func=_cmd_sweep)

    plot = sub.add_parser("plot", help="draw latency CDFs and sweep curves from result files")
    plot.add_argument("results", nargs="+", type=Path, help="result files of serve or sweep")
    plot.add_argument("--out", type=Path, required=True, help="directory for the PNG files")
    plot.set_defaults(func=_cmd_plot)
    return parser


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url",
        default=None,
        help="server root, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)",
    )
    g.add_argument("--host", default="127.0.0.1", help="vLLM's: the server's host (127.0.0.1)")
    g.add_argument("--port", type=_positive_int, default=8000, help="vLLM's: its port (8000)")
    g.add_argument("--model", required=True, help="model name sent in requests")
    g.add_argument(
        "--endpoint",
        type=_endpoint,
        default=None,
        help="completions (text prompt, /v1/completions) or chat (messages, "
        "/v1/chat/completions); default: completions, or chat with --backend openai-chat",
    )
    g.add_argument(
        "--backend",
        choices=("openai", "vllm", "openai-chat"),
        default="openai",
        help="vLLM's: openai-chat sends to the chat endpoint; the others to completions",
    )
    g.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    g.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds one request may take in all (default 600)",
    )
    g.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="more fields for every request body, e.g. '{\"top_p\": 0.9}'",
    )
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send `ignore_eos: true` (output may end before max_tokens)",
    )
    g.add_argument(
        "--ignore-eos",
        dest="ignore_eos",
        action="store_true",
        default=True,
        help="vLLM's: the default here",
    )

    g = p.add_argument_group("load")
    g.add_argument(
        "--num-prompts",
        type=_positive_int,
        default=100,
        help="requests to send (multi-turn: see --num-conversations)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    g.add_argument(
        "--request-rate",
        type=_rate,
        default=float("inf"),
        help="requests per second, Poisson arrivals; inf sends all at once",
    )
    g.add_argument(
        "--goodput",
        nargs="+",
        type=_slo,
        default=None,
        metavar="KIND:MS",
        help="SLOs in ms for goodput, any of ttft:MS tpot:MS e2el:MS",
    )

    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        "--dataset-name",
        type=_workload,
        default="random",
        metavar="{" + ",".join(WORKLOADS) + "}",
        help="random: random-token prompts; shared-prefix: groups sharing a long "
        "system prompt; multi-turn: conversations resending their history; "
        "long-short: a few long prompts among short ones; rewrite: repeat a given text or code "
        "(answers predictable from the prompt: speculative decoding's case); jsonl (vLLM's "
        "custom): a file",
    )
    g.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="HF tokenizer directory for prompt lengths (default: --model if it "
        "is a directory, else pdserve's default model)",
    )
    d = WorkloadParams()
    ints = (
        ("--random-input-len", d.random_input_len, "random: input tokens"),
        ("--random-output-len", d.random_output_len, "random: output tokens"),
        ("--num-groups", d.num_groups, "shared-prefix: groups, each with its own prefix"),
        ("--prefix-len", d.prefix_len, "shared-prefix: tokens of a group's system prompt"),
        ("--suffix-len", d.suffix_len, "shared-prefix: tokens of each question"),
        ("--num-conversations", d.num_conversations, "multi-turn: conversations"),
        ("--turns", d.turns, "multi-turn: requests per conversation"),
        ("--turn-input-len", d.turn_input_len, "multi-turn: new user tokens per turn"),
        ("--long-input-len", d.long_input_len, "long-short: tokens of a long prompt"),
        ("--short-input-len", d.short_input_len, "long-short: tokens of a short prompt"),
        ("--output-len", d.output_len, "shared-prefix, multi-turn, long-short: output tokens"),
        (
            "--rewrite-input-len",
            d.rewrite_input_len,
            "rewrite: tokens of the text or code to repeat (the output asks for as many)",
        ),
    )
    for flag, default, text in ints:
        g.add_argument(flag, type=_positive_int, default=default, help=f"{text} ({default})")
    g.add_argument(
        "--random-range-ratio",
        type=_ratio,
        default=d.random_range_ratio,
        help="random: lengths uniform in [len*(1-r), len*(1+r)] (0)",
    )
    g.add_argument(
        "--long-fraction",
        type=_ratio,
        default=d.long_fraction,
        help=f"long-short: fraction of long prompts ({d.long_fraction})",
    )
    g.add_argument(
        "--dataset-path",
        default=None,
        help='jsonl: file of {"prompt": ..., "output_len": N} or '
        '{"messages": [...], "output_len": N} lines',
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--result-file",
        "--result-filename",
        type=Path,
        default=None,
        help="write the results as JSON (in --result-dir when relative and that is given)",
    )
    g.add_argument(
        "--save-result",
        action="store_true",
        help="vLLM's: write the results even without --result-file, to "
        "BACKEND-RATEqps-concurrencyN-MODEL-YYYYmmdd-HHMMSS.json",
    )
    g.add_argument("--result-dir", type=Path, default=None, help="vLLM's: where results go")
    g.add_argument("--label", default="", help="name of this run in plots (default: file name)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


# vLLM's dataset names that are pdserve workloads under another name.
_DATASETS = {"custom": "jsonl"}


def _workload(text: str) -> str:
    name = _DATASETS.get(text, text)
    if name not in WORKLOADS:
        raise argparse.ArgumentTypeError(
            f"unknown workload {text!r}; use one of {', '.join(WORKLOADS)} (vLLM's names: "
            f"random, custom)"
        )
    return name


def _endpoint(text: str) -> str:
    """completions or chat, also as vLLM writes them (/v1/completions)."""
    by_path = {path: name for name, path in ENDPOINTS.items()}
    name = by_path.get(text, text)
    if name not in ENDPOINTS:
        raise argparse.ArgumentTypeError(
            f"unknown endpoint {text!r}; use {', '.join(ENDPOINTS)} or "
            f"{', '.join(ENDPOINTS.values())}"
        )
    return name


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _rate(text: str) -> float:
    return _positive_float(text)  # float("inf") parses "inf"


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [_positive_int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        ) from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _slo(text: str) -> tuple[str, float]:
    kind, sep, ms = text.partition(":")
    if not sep or kind not in SLO_KINDS:
        raise argparse.ArgumentTypeError(f"expected KIND:MS with KIND one of {SLO_KINDS}: {text!r}")
    try:
        value = float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {ms!r} is not a number of ms") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: an SLO cannot be negative")
    return kind, value


def main(argv: list[str] | None = None) -> int:
    """Run `pdserve bench` with `argv` (without the word "bench"); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command != "plot":
        _check_run_args(parser, args)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    if args.endpoint is None:
        args.endpoint = "chat" if args.backend == "openai-chat" else "completions"
    args.result_file = _result_path(args)
    if args.goodput:
        kinds = [kind for kind, _ in args.goodput]
        if len(set(kinds)) != len(kinds):
            parser.error(f"--goodput: each SLO kind at most once, got {' '.join(kinds)}")
    if args.workload == "jsonl":
        if args.dataset_path is None:
            parser.error("--workload jsonl needs --dataset-path FILE")
        if not Path(args.dataset_path).is_file():
            parser.error(f"--dataset-path {args.dataset_path}: no such file")
    tokenizer = _tokenizer_dir(args)
    if tokenizer is None and args.workload != "jsonl":
        parser.error(
            f"--tokenizer: no tokenizer directory found (--model {args.model} is not a "
            "directory and pdserve's default model is not prepared); pass --tokenizer DIR"
        )
    if tokenizer is not None and not tokenizer.is_dir():
        parser.error(f"--tokenizer {tokenizer}: not a directory")


def _result_path(args: argparse.Namespace) -> Path | None:
    """Where the results go: --result-file (under --result-dir when relative), else with
    --save-result vLLM's file name; None: not written."""
    path = args.result_file
    if path is None and args.save_result:
        concurrency = getattr(args, "max_concurrency", None)
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        model = Path(args.model).name
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(f"{args.backend}-{rate}qps-concurrency{concurrency}-{model}-{stamp}.json")
    if path is not None and args.result_dir is not None and not path.is_absolute():
        path = args.result_dir / path
    return path


def _tokenizer_dir(args: argparse.Namespace) -> Path | None:
    """--tokenizer, else --model when it is a directory, else pdserve's default model."""
    if args.tokenizer is not None:
        return args.tokenizer
    if Path(args.model).is_dir():
        return Path(args.model)
    from pdserve.core.model import default_model_dir

    return default_model_dir() if default_model_dir().is_dir() else None


def _sessions(args: argparse.Namespace) -> list[Session]:
    names = {f.name for f in fields(WorkloadParams)}
    params = WorkloadParams(**{k: v for k, v in vars(args).items() if k in names})
    path = _tokenizer_dir(args)
    tok = load_tokenizer(path) if path is not None else None
    return build_workload(args.workload, params, tok, args.num_prompts, args.seed)


def _run_config(args: argparse.Namespace) -> dict:
    """The flags as JSON (the API key only as whether one was given)."""
    names = {f.name for f in fields(WorkloadParams)}
    config = {
        k: v
        for k, v in vars(args).items()
        if k not in names
        and k not in ("func", "api_key", "goodput", "timeout", "host", "port", "save_result")
    }
    config.update(
        request_rate="inf" if args.request_rate == float("inf") else args.request_rate,
        timeout_s=args.timeout,
        api_key_set=args.api_key is not None,
        goodput_slos_ms=dict(args.goodput or []),
        workload_params=asdict(WorkloadParams(**{k: getattr(args, k) for k in names})),
        tokenizer=str(_tokenizer_dir(args) or ""),
    )
    return {k: str(v) if isinstance(v, Path) else v for k, v in config.items()}


def _client_config(args: argparse.Namespace, max_concurrency: int | None) -> ClientConfig:
    return ClientConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        max_concurrency=max_concurrency,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        timeout_s=args.timeout,
        seed=args.seed,
        extra_body=tuple(args.extra_body.items()),
    )


def run(
    config: ClientConfig,
    sessions: list[Session],
    slos_ms: dict[str, float],
    progress: bool = True,
) -> tuple[RunResult, BenchmarkMetrics]:
    """Send the sessions (with a progress bar) and compute the run's metrics."""
    from tqdm import tqdm

    with tqdm(total=num_requests(sessions), disable=not progress, file=sys.stderr) as bar:
        result = asyncio.run(run_sessions(config, sessions, on_done=lambda r: bar.update(1)))
    return result, compute_metrics(result.records, result.duration_s, slos_ms)


def _serve_once(args: argparse.Namespace, sessions: list[Session], concurrency: int | None):
    config = _client_config(args, concurrency)
    result, metrics = run(config, sessions, dict(args.goodput or []), not args.no_progress)
    print(summary(metrics, result.records, concurrency, args.request_rate), flush=True)
    run_config = {**_run_config(args), "max_concurrency": concurrency}
    run_config.pop("concurrencies", None)
    return serve_result(run_config, metrics, result.records, args.label), metrics


def _cmd_serve(args: argparse.Namespace) -> int:
    result, metrics = _serve_once(args, _sessions(args), args.max_concurrency)
    if args.result_file:
        write_result(result, args.result_file)
        print(f"wrote {args.result_file}")
    return 0 if metrics.completed else 1


def _cmd_sweep(args: argparse.Namespace) -> int:
    sessions = _sessions(args)
    runs, completed = [], 0
    if args.prompts_per_concurrency is not None and args.prompts_per_concurrency < 1:
        raise SystemExit("--prompts-per-concurrency must be 1 or more")
    for concurrency in args.concurrencies:
        print(f"\nmax concurrency {concurrency}:", flush=True)
        some = sessions
        if args.prompts_per_concurrency:
            some = sessions[: args.prompts_per_concurrency * concurrency]
        result, metrics = _serve_once(args, some, concurrency)
        runs.append(result)
        completed += metrics.completed
    if args.result_file:
        config = _run_config(args)
        write_result(sweep_result(config, args.concurrencies, runs, args.label), args.result_file)
        print(f"wrote {args.result_file}")
    return 0 if completed else 1


def _cmd_plot(args: argparse.Namespace) -> int:
    from pdserve.loadgen.plot import plot_results

    for path in plot_results(args.results, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
