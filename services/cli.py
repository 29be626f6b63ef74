"""The `pdserve` command."""

from __future__ import annotations

import argparse
import logging
import sys


def _cmd_prepare_model(ns: argparse.Namespace) -> int:
    from services.engine.prepare_model import prepare_default_model

    path = prepare_default_model(home=ns.home, force=ns.force, progress=not ns.quiet)
    print(path)
    return 0


def _sampling(ns: argparse.Namespace):
    from services.engine import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sampling_seed,
    )


def _make_llm(ns: argparse.Namespace):
    from services.engine import LLM
    from services.engine.cli_args import engine_args_from

    args = engine_args_from(ns)
    kwargs = {k: v for k, v in vars(args).items() if k != "model"}
    return LLM(model=args.model, **kwargs)


def _cmd_generate(ns: argparse.Namespace) -> int:
    params = _sampling(ns)
    llm = _make_llm(ns)
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompts], params)
    else:
        outputs = llm.generate(list(ns.prompts), params)
    for out in outputs:
        print(out.text)
    return 0


def _cmd_chat(ns: argparse.Namespace) -> int:
    from services.engine.interactive import chat_loop

    params = _sampling(ns)
    llm = _make_llm(ns)
    return chat_loop(llm, params, system=ns.system)


def _cmd_up(ns: argparse.Namespace) -> int:
    from services.up import run, settings_from

    return run(settings_from(ns))


def _cmd_status(ns: argparse.Namespace) -> int:
    from services.status import run

    return run(ns)


def _cmd_kvstore(ns: argparse.Namespace) -> int:
    from services.kvstore.cli import run, settings_from

    return run(settings_from(ns))


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the request's sampling")


def build_parser() -> argparse.ArgumentParser:
    from services.engine.cli_args import add_engine_args

    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Serve open-weight LLMs with prefill and decode disaggregated.",
    )
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "prepare-model", help="convert the bundled SmolLM2-135M-Instruct GGUF to safetensors, once"
    )
    p.add_argument(
        "--home", default=None, help="cache directory [env PDSERVE_HOME; default ~/.cache/pdserve]"
    )
    p.add_argument("--force", action="store_true", help="convert again even if already prepared")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_cmd_prepare_model)

    p = sub.add_parser(
        "generate", help="generate completions for prompts given on the command line"
    )
    p.add_argument("prompts", nargs="+", help="prompt texts")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the chat template",
    )
    _add_sampling_flags(p)
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="chat with the model in the terminal")
    p.add_argument("--system", default=None, help="system prompt")
    _add_sampling_flags(p)
    add_engine_args(p)
    p.set_defaults(func=_cmd_chat)

    from services.up import add_up_args

    p = sub.add_parser(
        "up",
        help="start the whole cluster on this machine: Redis, kvstore, workers, gateway",
        description="Start Redis (unless --redis-url), a kvstore, --prefill prefill and "
        "--decode decode workers (loading their models in parallel, each pinned to its own "
        "CPU cores) and then the gateway; print its addresses and wait. Ctrl-C stops it all: "
        "the gateway first, then the workers, the kvstore and Redis. The engine flags go to "
        "every worker; logs go to --log-dir.",
    )
    add_up_args(p)
    add_engine_args(p)
    p.set_defaults(func=_cmd_up)

    from services.status import add_status_args

    p = sub.add_parser(
        "status",
        help="show the registered workers and kvstores of a cluster, and their load",
        description="Read the registry in Redis once and print a table per pool (prefill, "
        "decode, kvstore): address, model, running and waiting requests, KV blocks in use, "
        "prefix cache hits, kvstore bytes, and the age of each entry's last heartbeat.",
    )
    add_status_args(p)
    p.set_defaults(func=_cmd_status)

    for name, (_, help_text) in _SERVICES.items():
        sub.add_parser(name, help=help_text, add_help=False)

    from services.kvstore.cli import add_kvstore_args

    p = sub.add_parser("kvstore", help="serve the KV block store (blocks from prefill to decode)")
    add_kvstore_args(p)
    p.set_defaults(func=_cmd_kvstore)
    return parser


# Services with their own flags: `pdserve prefill ...` is `python -m services.prefill ...`.
_SERVICES = {
    "prefill": ("services.prefill.server", "run a prefill worker (see `pdserve prefill --help`)"),
    "decode": ("services.decode.server", "run a decode worker (see `pdserve decode --help`)"),
    "gateway": (
        "services.gateway.__main__",
        "run the gateway: gRPC and OpenAI REST fronts (see `pdserve gateway --help`)",
    ),
    "bench": (
        "bench.cli",
        "benchmark any OpenAI-compatible server: serve, sweep, plot (see `pdserve bench --help`)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _SERVICES:
        import importlib

        return importlib.import_module(_SERVICES[argv[0]][0]).main(argv[1:])
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
