"""Run a command's real entry point only as far as parsing its arguments.

``parse_all`` calls the ``pdserve`` command's ``main(argv)``, or runs a module or a script as
``python -m`` or ``python FILE`` would, with argparse patched to stop right after a
successful parse: for a settings command, after its settings object is built, so that a
value its ``__post_init__`` refuses fails too. Nothing past the parse runs. A flag must be
spelled out (no abbreviations). The answer for each command is None (it parsed) or the
error it printed.

``pdserve`` commands are parsed in the caller's process, which this never makes import
torch: a command whose imports reach torch stops there (unless torch is imported already).
Those, and every module or script (whose top level runs again on each run, registering
what it registers again), are parsed in one child process (``python -m
tests.helpers.parse_only``, the commands on stdin).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import io
import json
import os
import runpy
import subprocess
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from pdserve.settings import flags

ROOT = Path(__file__).resolve().parents[2]
ENV_PREFIX = "PDSERVE_"
_RESULT = "parse_only results: "  # the child's answer line


@dataclasses.dataclass(frozen=True)
class Entry:
    """A command line to parse: its entry point, arguments and environment."""

    kind: str  # "pdserve" (pdserve.cli.main), "module" (python -m), "script" (python FILE)
    target: str  # the module, or the script's path from the root; "" for pdserve
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    fragment: bool = False  # a part of a command: its required arguments may be missing


class _Parsed(BaseException):
    """Raised right after a successful parse: the command goes no further."""


class NeedsTorch(BaseException):  # not an ImportError: no `except ImportError` hides it
    """The entry point imports torch, which this process keeps out."""


def parse_all(entries: Sequence[Entry], root: Path = ROOT) -> list[str | None]:
    """Each entry's parse error, or None where it parsed."""
    results: dict[int, str | None] = {}
    in_child: list[int] = []
    torch_entry_points: set[tuple[str, str]] = set()
    for i, entry in enumerate(entries):
        point = _entry_point(entry)
        if entry.kind != "pdserve" or point in torch_entry_points:
            in_child.append(i)
            continue
        try:
            results[i] = parse_one(entry, root, allow_torch=False)
        except NeedsTorch:
            torch_entry_points.add(point)
            in_child.append(i)
    if in_child:
        answers = _parse_in_child([entries[i] for i in in_child], root)
        results.update(zip(in_child, answers, strict=True))
    return [results[i] for i in range(len(entries))]


def _entry_point(entry: Entry) -> tuple[str, str]:
    if entry.kind == "pdserve":
        return entry.kind, entry.argv[0] if entry.argv else ""
    return entry.kind, entry.target


def parse_one(entry: Entry, root: Path, allow_torch: bool) -> str | None:
    """Run ``entry`` until its arguments are parsed; the error it printed, or None."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")  # runpy's "found in sys.modules", deprecations
            stack.enter_context(_environment(dict(entry.env)))
            stack.enter_context(_stop_after_parse(entry.fragment))
            if not allow_torch:
                stack.enter_context(_without_torch())
            code = _run(entry, root)
    except _Parsed:
        return None
    except SystemExit as stop:
        code = stop.code
    except Exception as error:
        return f"raised {error!r} before its arguments were parsed"
    finally:
        sys.argv = saved_argv  # _run binds a new list
        sys.path[:] = saved_path  # a module's top level may have added to it
    if code in (0, None):  # e.g. --help
        return None
    if isinstance(code, str):
        return code
    return _last_line(err.getvalue()) or _last_line(out.getvalue()) or f"exit code {code}"


def _run(entry: Entry, root: Path) -> int | None:
    if entry.kind == "pdserve":
        from pdserve.cli import main

        return main(list(entry.argv))
    if entry.kind == "module":
        sys.argv = [entry.target, *entry.argv]
        runpy.run_module(entry.target, run_name="__main__", alter_sys=True)
        return None
    path = str(root / entry.target)
    sys.argv = [path, *entry.argv]
    runpy.run_path(path, run_name="__main__")
    return None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# -- the patches ------------------------------------------------------------------------


@contextlib.contextmanager
def _stop_after_parse(fragment: bool) -> Iterator[None]:
    """argparse and ``flags.from_namespace`` raise ``_Parsed`` once the outermost parse is
    done (a subcommand's parser runs inside its parent's). A whole command's settings are
    built too, so that their checks run; a fragment's are not (`pdserve gateway` alone
    names the command: it need not say where the workers are)."""
    depth = 0
    parse_args = argparse.ArgumentParser.parse_args
    parse_known_args = argparse.ArgumentParser.parse_known_args
    from_namespace = flags.from_namespace

    def patched_known(self, args=None, namespace=None):
        nonlocal depth
        args = _fill_placeholders(self, list(sys.argv[1:] if args is None else args))
        # A doc spells a flag out: its `--prefil` would break once a `--prefix` exists.
        self.allow_abbrev = False
        if fragment:
            _relax(self)
        depth += 1
        try:
            parsed = parse_known_args(self, args, namespace)
        finally:
            depth -= 1
        if depth == 0:
            raise _Parsed
        return parsed

    def patched_args(self, args=None, namespace=None):
        nonlocal depth
        settings_follow = not fragment and sys._getframe(1).f_code is flags.parse_with.__code__
        depth += 1
        try:
            parsed = parse_args(self, args, namespace)
        finally:
            depth -= 1
        if depth == 0 and not settings_follow:
            raise _Parsed
        return parsed

    def patched_from_namespace(cls, ns):
        from_namespace(cls, ns)  # a refused value raises SettingsError here
        raise _Parsed

    argparse.ArgumentParser.parse_known_args = patched_known
    argparse.ArgumentParser.parse_args = patched_args
    flags.from_namespace = patched_from_namespace
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = parse_known_args
        argparse.ArgumentParser.parse_args = parse_args
        flags.from_namespace = from_namespace


def is_placeholder(word: str) -> bool:
    """``<PORT>``, ``<...>`` or an all-capitals word such as ``P``, ``DIR``, ``N``."""
    return (word.startswith("<") and word.endswith(">")) or (
        word[:1].isupper() and word.replace("_", "").isalnum() and word.upper() == word
    )


def _fill_placeholders(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """A placeholder its flag cannot take (``--http-port P``) becomes a value it can."""
    out = list(args)
    for i, word in enumerate(out):
        flag, eq, value = word.partition("=")
        action = parser._option_string_actions.get(flag)
        if action is None or action.nargs == 0:
            continue
        if eq and is_placeholder(value) and not _accepts(action, value):
            out[i] = f"{flag}={_sample(action, value)}"
        elif not eq and i + 1 < len(out) and is_placeholder(out[i + 1]):
            value = out[i + 1]
            out[i + 1] = value if _accepts(action, value) else _sample(action, value)
    return out


def _accepts(action: argparse.Action, value: str) -> bool:
    try:
        converted = action.type(value) if callable(action.type) else value
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return not action.choices or converted in action.choices


def _sample(action: argparse.Action, word: str) -> str:
    if action.choices:
        return str(next(iter(action.choices)))
    default = action.default
    if (
        default is not None
        and default is not argparse.SUPPRESS
        and isinstance(default, int | float | str)
    ):
        return str(default)
    return {int: "1", float: "1.0"}.get(action.type, word)


def _relax(parser: argparse.ArgumentParser) -> None:
    """A fragment's parser asks for no argument: only what is given must be right."""
    for action in parser._actions:
        action.required = False
        if not action.option_strings and action.nargs in (None, "+"):
            action.nargs = "?" if action.nargs is None else "*"


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` over this process's environment without its own ``PDSERVE_*`` variables."""
    touched = {n for n in os.environ if n.startswith(ENV_PREFIX)} | set(env)
    saved = {name: os.environ.get(name) for name in touched}
    for name in touched:
        os.environ.pop(name, None)
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _TorchBlocker(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds torch (so ``find_spec`` says it is installed) but raises ``NeedsTorch`` on
    import, before any of it runs."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise NeedsTorch(module.__name__)


@contextlib.contextmanager
def _without_torch() -> Iterator[None]:
    blocker = _TorchBlocker()
    sys.meta_path.insert(0, blocker)
    try:
        yield
    finally:
        sys.meta_path.remove(blocker)


# -- the child ---------------------------------------------------------------------------


def _parse_in_child(entries: list[Entry], root: Path) -> list[str | None]:
    """``parse_one`` of each entry, in a fresh process that may import torch."""
    request = json.dumps([dataclasses.asdict(e) for e in entries])
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.helpers.parse_only"],
            input=request,
            capture_output=True,
            text=True,
            cwd=root,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return ["the child process that parses commands timed out"] * len(entries)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_RESULT):
            return json.loads(line.removeprefix(_RESULT))
    failure = _last_line(done.stderr) or f"exit code {done.returncode}"
    return [f"the child process that parses commands failed: {failure}"] * len(entries)


def _child_main() -> int:
    entries = [
        Entry(e["kind"], e["target"], tuple(e["argv"]), tuple(map(tuple, e["env"])), e["fragment"])
        for e in json.loads(sys.stdin.read())
    ]
    results = [parse_one(entry, Path.cwd(), allow_torch=True) for entry in entries]
    print(_RESULT + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
