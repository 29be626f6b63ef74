"""The `pdserve` command: one subcommand per service or tool, each imported only when run
(so that `pdserve gateway` and `pdserve kvstore` never load torch)."""

from __future__ import annotations

import importlib
import sys

# name: (module, function, help)
COMMANDS = {
    "up": (
        "pdserve.up",
        "main",
        "start the whole cluster on this machine: Redis, kvstore, workers, gateway",
    ),
    "status": ("pdserve.status", "main", "show a cluster's registered workers and their load"),
    "gateway": (
        "pdserve.gateway.server",
        "main",
        "run the gateway: the gRPC and OpenAI REST fronts",
    ),
    "prefill": ("pdserve.prefill.server", "main", "run a prefill worker"),
    "decode": ("pdserve.decode.server", "main", "run a decode worker"),
    "kvstore": ("pdserve.kvstore.server", "main", "run the KV block store"),
    "prepare-model": (
        "pdserve.engine.prepare_model",
        "main",
        "convert the bundled SmolLM2-135M-Instruct GGUF to safetensors, once",
    ),
    "generate": ("pdserve.engine.cli", "generate_main", "generate completions of prompts"),
    "chat": ("pdserve.engine.cli", "chat_main", "chat with the model in the terminal"),
    "profile": (
        "pdserve.planner.profile",
        "main",
        "measure a prefill and a decode worker of a model on this machine, for `plan`",
    ),
    "plan": (
        "pdserve.planner.plan",
        "main",
        "the replicas per pool that meet TTFT and ITL targets for a traffic",
    ),
    "planner": (
        "pdserve.planner.online",
        "main",
        "size a running cluster's prefill and decode pools to its traffic, continuously",
    ),
    "bench": (
        "pdserve.loadgen.cli",
        "main",
        "benchmark any OpenAI-compatible server: serve, sweep, plot",
    ),
}

USAGE = "usage: pdserve COMMAND [--help] [flags]"


def help_text() -> str:
    """The top-level help: what each command does."""
    width = max(len(name) for name in COMMANDS)
    lines = [
        USAGE,
        "",
        "Serve open-weight LLMs with prefill and decode disaggregated.",
        "",
        "commands:",
        *(f"  {name.ljust(width)}  {help}" for name, (_, _, help) in COMMANDS.items()),
        "",
        "`pdserve COMMAND --help` lists a command's flags; each flag can also be set by the "
        "PDSERVE_* variable its help names.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv[0]`` with the rest of ``argv``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"{USAGE}\npdserve: error: unknown command {name!r}; one of: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    module, function, _ = COMMANDS[name]
    return getattr(importlib.import_module(module), function)(rest)


if __name__ == "__main__":
    sys.exit(main())
