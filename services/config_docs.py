"""docs/configuration.md, written from the settings classes and the parsers themselves, so
that the flags, variables and defaults it lists cannot drift from the code.

    python -m pdserve.config_docs docs/configuration.md   # write it (no path: print it)

Per command: each group of flags with its ``PDSERVE_*`` variable, default (secrets masked)
and help; a group exactly like one listed earlier (the engine flags of every worker) links
there instead. Then ``pdserve bench``'s subcommands (argparse, no variables) and
``VARIABLES``. Nothing here imports torch. tests/unit/test_docs.py fails when the
committed file differs from what this writes.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pdserve.cli import COMMANDS
from pdserve.loadgen.cli import build_parser as bench_parser
from pdserve.settings.commands import (
    ChatSettings,
    GenerateSettings,
    PrepareModelSettings,
    StatusSettings,
    UpSettings,
)
from pdserve.settings.flags import Option, options
from pdserve.settings.planner import PlannerSettings, PlanSettings, ProfileSettings
from pdserve.settings.services import (
    DecodeSettings,
    GatewaySettings,
    KVStoreSettings,
    PrefillSettings,
)
from pdserve.settings.variables import VARIABLES

REGENERATE = ".venv/bin/python -m pdserve.config_docs docs/configuration.md"

# command -> its settings class, in the order the page lists them
SETTINGS: dict[str, type] = {
    "gateway": GatewaySettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
    "kvstore": KVStoreSettings,
    "up": UpSettings,
    "generate": GenerateSettings,
    "chat": ChatSettings,
    "status": StatusSettings,
    "prepare-model": PrepareModelSettings,
    "profile": ProfileSettings,
    "plan": PlanSettings,
    "planner": PlannerSettings,
}
ARGPARSE_COMMANDS = {"bench"}  # commands with a parser of their own, listed after

INTRO = f"""\
# Configuration

<!-- Generated from the settings classes by `{REGENERATE}`; do not edit by hand. -->

Every flag of a pdserve command can also be set by the `PDSERVE_*` environment variable
named beside it (`--max-num-seqs 8` is `PDSERVE_MAX_NUM_SEQS=8`); a flag given on the
command line wins, then the variable, then the default. A boolean flag is a switch: `--X`
turns it on, `--no-X` off, and `--X=off` (or true/false, yes/no, 1/0) sets it; on commands
without positional arguments the word after it may be its value (`--disaggregation off`),
never on `pdserve generate`. A `PDSERVE_*` variable set to true/false, yes/no, 1/0 or on/off
sets a boolean the same way. A `PDSERVE_*` variable that no command reads is warned about at
start. `pdserve COMMAND --help` prints the same flags.
"""


def render() -> str:
    """The whole page."""
    missing = set(COMMANDS) - set(SETTINGS) - ARGPARSE_COMMANDS
    if missing:
        raise SystemExit(f"bug: pdserve.config_docs has no settings class for {sorted(missing)}")
    sections = [INTRO, _contents()]
    seen: dict[tuple, tuple[str, str]] = {}  # a group's rows -> (heading, anchor) listing them
    for name, cls in SETTINGS.items():
        sections.append(_settings_section(name, cls, seen))
    sections.append(_bench_section(seen))
    sections.append(_variables_section())
    return "\n".join(sections)


def _contents() -> str:
    names = [*SETTINGS, *(f"bench {sub}" for sub in _bench_subparsers())]
    items = [f"- [`pdserve {n}`](#{_slug('pdserve ' + n)})" for n in names]
    items.append(f"- [Variables that are not flags](#{_slug('Variables that are not flags')})")
    return "\n".join(items) + "\n"


def _settings_section(name: str, cls: type, seen: dict[tuple, tuple[str, str]]) -> str:
    out = [f"## `pdserve {name}`", "", _sentence(COMMANDS[name][2]), ""]
    for group, opts in _groups(options(cls)):
        rows = tuple(_settings_row(opt) for opt in opts)
        header = "| flag | variable | default | what it sets |"
        out += _group(f"pdserve {name}: {group}", header, rows, seen)
    return "\n".join(out)


def _group(
    heading: str, header: str, rows: tuple[str, ...], seen: dict[tuple, tuple[str, str]]
) -> list[str]:
    """A group's table, or a link to the same table listed earlier."""
    if rows in seen:
        earlier, anchor = seen[rows]
        return [f"### {heading}\n", f"The same flags as [{earlier}](#{anchor}).\n"]
    seen[rows] = (heading, _slug(heading))
    rule = "|" + "---|" * header.count(" | ") + "---|"
    return [f"### {heading}\n", header, rule, *rows, ""]


def _groups(opts: Iterable[Option]) -> list[tuple[str, list[Option]]]:
    groups: dict[str, list[Option]] = {}
    for opt in opts:
        groups.setdefault(opt.group, []).append(opt)
    return list(groups.items())


def _settings_row(opt: Option) -> str:
    default = "(hidden)" if opt.secret else _default(opt.default)
    if opt.choices:
        default += " (" + ", ".join(opt.choices) + ")"
    cells = (_code(opt.flag), _code(opt.env), default, _cell(opt.help))
    return "| " + " | ".join(cells) + " |"


def _bench_subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = bench_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _bench_section(seen: dict[tuple, tuple[str, str]]) -> str:
    out = []
    for name, parser in _bench_subparsers().items():
        out += [f"## `pdserve bench {name}`", "", _sentence(_subcommand_help(name))]
        out.append("Flags only: `pdserve bench` reads no `PDSERVE_*` variables.\n")
        for group in parser._action_groups:
            actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
            actions = [a for a in actions if not isinstance(a, argparse._HelpAction)]
            if not actions:
                continue
            rows = tuple(_bench_row(a, parser.prog) for a in actions)
            out += _group(
                f"pdserve bench {name}: {group.title}",
                "| flag | default | what it sets |",
                rows,
                seen,
            )
    return "\n".join(out)


def _subcommand_help(name: str) -> str:
    parser = bench_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return next(a.help for a in sub._choices_actions if a.dest == name)


def _bench_row(action: argparse.Action, prog: str) -> str:
    flag = ", ".join(action.option_strings) or action.metavar or action.dest.upper()
    if action.required and action.option_strings:
        default = "required"
    elif not action.option_strings:
        default = "required" if action.nargs in (None, "+") else ""
    else:
        default = _default(action.default)
    if action.choices and not isinstance(action.choices, dict):
        default += " (" + ", ".join(map(str, action.choices)) + ")"
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    text = (action.help or "") % dict(params, prog=prog)  # what argparse's help shows
    return f"| {_code(flag)} | {default} | {_cell(text)} |"


def _variables_section() -> str:
    out = [
        "## Variables that are not flags",
        "",
        "These act where no flag reaches (pdserve.settings.variables).",
        "",
        "| variable | what it does |",
        "|---|---|",
    ]
    out += [f"| {_code(name)} | {_cell(text)} |" for name, text in sorted(VARIABLES.items())]
    return "\n".join(out) + "\n"


def _default(value: Any) -> str:
    return "unset" if value is None else _code(_shown(value))


def _shown(value: Any) -> str:
    """A default as a user would type it (``--help`` shows the same words)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value)) or "none"
    return str(value) or '""'


def _code(text: str) -> str:
    """``text`` as inline code in a table cell (a backtick inside gets a longer fence)."""
    fence = "``" if "`" in text else "`"
    return f"{fence}{text.replace('|', chr(92) + '|')}{fence}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sentence(text: str) -> str:
    text = text.strip()
    return (text[:1].upper() + text[1:]).rstrip(".") + "."


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    """Write the page to the path given, else print it."""
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.config_docs", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out", nargs="?", type=Path, help="where to write it (default: stdout)")
    args = parser.parse_args(argv)
    text = render()
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
