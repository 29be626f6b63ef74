"""One settings mechanism for every pdserve command: a frozen dataclass is the whole spec.

Each field of a settings dataclass is a command-line flag (``max_num_seqs`` ->
``--max-num-seqs``, unless ``setting(flag=...)`` names another), an environment variable
(``PDSERVE_MAX_NUM_SEQS``, always from the field name) that sets the flag's default,
a default, and a help text. A field whose type is itself a settings dataclass adds that
class's flags as a group (a worker's settings hold an ``EngineArgs``). Values are checked
once, in each class's ``__post_init__``, with messages that name the flag to change.

    settings = parse_settings(KVStoreSettings, argv, prog="pdserve kvstore", description=...)
    argv = to_argv(settings)  # the flags that give a child process the same settings
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from pdserve.core.errors import SettingsError

logger = logging.getLogger(__name__)

ENV_PREFIX = "PDSERVE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

S = TypeVar("S")


def check(ok: bool, message: str) -> None:
    """Raise SettingsError(message) unless ``ok``."""
    if not ok:
        raise SettingsError(message)


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    default_factory: Callable[[], Any] | None = None,
    secret: bool = False,
) -> Any:
    """A settings field: its default, help text and, where the field name will not do, its flag.

    ``secret`` keeps the value out of reprs, logs and ``--help``.
    """
    metadata = {"help": help, "flag": flag, "choices": choices, "metavar": metavar}
    kwargs: dict[str, Any] = {"metadata": metadata, "repr": not secret}
    if default_factory is not None:
        kwargs["default_factory"] = default_factory
    else:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


def parse_bool(text: str | bool) -> bool:
    """on/off, true/false, yes/no, 1/0 (any case)."""
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(
        f"expected on or off (or true/false, yes/no, 1/0), got {text!r}"
    )


# -- describing fields --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Option:
    """One flag of a settings class, as the parser, the environment and ``to_argv`` see it."""

    path: tuple[str, ...]  # attribute path from the top-level settings object
    flag: str  # "--max-num-seqs"
    env: str  # "PDSERVE_MAX_NUM_SEQS"
    kind: type  # int, float, str, bool, or tuple for a repeatable flag
    default: Any
    help: str
    group: str
    choices: Sequence[str] | None = None
    metavar: str | None = None
    secret: bool = False


def options(cls: type) -> list[Option]:
    """Every flag of ``cls`` (nested settings classes flattened), in declaration order."""
    return list(_options(cls, (), None))


def _options(cls: type, prefix: tuple[str, ...], defaults: Any) -> Iterable[Option]:
    """``defaults``: the instance a parent field defaults to (it may differ from ``cls()``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        default = _default(f) if defaults is None else getattr(defaults, f.name)
        if dataclasses.is_dataclass(hint):
            yield from _options(hint, (*prefix, f.name), default)
            continue
        meta = f.metadata
        yield Option(
            path=(*prefix, f.name),
            flag=meta.get("flag") or "--" + f.name.replace("_", "-"),
            env=ENV_PREFIX + f.name.upper(),
            kind=_kind(hint, cls, f.name),
            default=default,
            help=meta.get("help", ""),
            group=_group_of(cls),
            choices=meta.get("choices"),
            metavar=meta.get("metavar"),
            secret=not f.repr,
        )


def _group_of(cls: type) -> str:
    return getattr(cls, "GROUP", cls.__name__)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"bug: settings field {f.name} has no default")


def _kind(hint: Any, cls: type, name: str) -> type:
    """int, float, str or bool (an optional one too), or tuple for ``tuple[str, ...]``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        hint, origin = args[0], typing.get_origin(args[0])
    if origin is tuple:
        return tuple
    if hint in (int, float, str, bool):
        return hint
    raise TypeError(f"bug: {cls.__name__}.{name} has a type settings cannot parse: {hint}")


# -- flags --------------------------------------------------------------------------------


class _BoolAction(argparse.Action):
    """A switch: ``--x`` (on), ``--no-x`` (off). ``_Parser`` turns ``--x=off`` (any of
    parse_bool's words) into one of them; the switch itself never takes the next word, so
    ``pdserve generate --chat PROMPT`` keeps its prompt."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        flag = option_strings[0]
        super().__init__([flag, "--no-" + flag[2:]], dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, not option_string.startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose bool flags also take a value after ``=`` (``--chat=off``).

    On a command without positional arguments, the word after a bool flag is its value too
    (``--disaggregation off``, as scripts and docs write it): nothing else could be meant.
    On one with positional arguments (``pdserve generate``'s prompts) it never is.
    """

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._fold_bool_values(args), namespace)

    def _fold_bool_values(self, args: list[str]) -> list[str]:
        """``args`` with each bool flag and its value written as ``--x`` or ``--no-x``."""
        flags = {a.option_strings[0] for a in self._actions if isinstance(a, _BoolAction)}
        next_word_is_value = all(a.option_strings for a in self._actions)
        out: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if arg == "--":  # what follows is positional
                return out + args[i - 1 :]
            flag, eq, value = arg.partition("=")
            if flag not in flags:
                out.append(arg)
                continue
            if not eq:
                word = args[i] if i < len(args) else "-"
                if word.startswith("-") or not next_word_is_value:
                    out.append(flag)
                    continue
                value = word
                i += 1
            try:
                on = parse_bool(value)
            except argparse.ArgumentTypeError as error:
                self.error(f"{flag}: {error}")
            out.append(flag if on else "--no-" + flag[2:])
        return out


class _ListAction(argparse.Action):
    """A repeatable flag whose values replace its default (e.g. a variable's list)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        setattr(namespace, self.dest, [*items, values])


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add ``cls``'s flags to ``parser``, one argument group per settings class."""
    groups: dict[str, Any] = {}
    for opt in options(cls):
        if opt.group not in groups:
            groups[opt.group] = parser.add_argument_group(opt.group)
        _add(groups[opt.group], opt)


def _add(group: Any, opt: Option) -> None:
    dest = "__".join(opt.path)
    metavar = opt.metavar or opt.path[-1].upper()
    env = os.environ.get(opt.env)
    shown = "(hidden)" if opt.secret else _show(opt.default)
    help_text = f"{opt.help} [env {opt.env}; default: {shown}]".lstrip()
    kwargs: dict[str, Any] = {"dest": dest, "help": help_text}
    if opt.kind is bool:
        default = opt.default if env is None else _env_value(opt, env, parse_bool)
        group.add_argument(opt.flag, action=_BoolAction, default=default, **kwargs)
        return
    if opt.kind is tuple:
        default = opt.default if env is None else tuple(_split_list(env))
        group.add_argument(opt.flag, action=_ListAction, default=default, metavar=metavar, **kwargs)
        return
    default = opt.default if env is None else _env_value(opt, env, opt.kind)
    if default is not None and opt.choices and default not in opt.choices:
        raise SettingsError(f"{opt.env}: expected one of {', '.join(opt.choices)}, got {env!r}")
    group.add_argument(
        opt.flag,
        type=opt.kind,
        default=default,
        choices=opt.choices,
        metavar="{" + ",".join(opt.choices) + "}" if opt.choices else metavar,
        **kwargs,
    )


def _env_value(opt: Option, text: str, parse: Callable[[str], Any]) -> Any:
    try:
        return parse(text)
    except (argparse.ArgumentTypeError, ValueError):
        raise SettingsError(
            f"{opt.env}={text!r} is not a valid value of {opt.flag} ({opt.kind.__name__})"
        ) from None


def _split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return str(value)


def from_namespace(cls: type[S], ns: argparse.Namespace) -> S:
    """An instance of ``cls`` from parsed flags; its ``__post_init__`` checks every value."""
    return _build(cls, (), ns)


def _build(cls: type, prefix: tuple[str, ...], ns: argparse.Namespace) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = (*prefix, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = _build(hints[f.name], path, ns)
        else:
            value = getattr(ns, "__".join(path))
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """The parser of a command whose flags are ``cls``'s (every command's --help looks alike).

    A ``PDSERVE_*`` variable that is not a valid value of its flag exits 2 naming both.
    """
    parser = _Parser(
        prog=prog,
        description=description,
        epilog="Every flag can also be set by the environment variable named in its help; "
        "a flag given on the command line wins.",
    )
    try:
        add_arguments(parser, cls)
    except SettingsError as error:
        parser.error(str(error))
    return parser


def parse_with(parser: argparse.ArgumentParser, cls: type[S], argv: Sequence[str] | None):
    """``(settings, namespace)`` from ``argv`` (the namespace holds a command's positional
    arguments); a bad value exits 2 with the message of the check that refused it."""
    ns = parser.parse_args(argv)
    try:
        return from_namespace(cls, ns), ns
    except SettingsError as error:
        parser.error(str(error))


def parse_settings(cls: type[S], argv: Sequence[str] | None, prog: str, description: str) -> S:
    """Parse ``argv`` into ``cls``; a bad flag or variable exits 2 with a message naming it."""
    return parse_with(build_parser(cls, prog, description), cls, argv)[0]


# -- back to flags --------------------------------------------------------------------------


def to_argv(settings: Any, *, only_changed: bool = True, secrets: bool = True) -> list[str]:
    """The flags that make ``parse_settings`` give back ``settings``; ``secrets=False`` leaves
    the secret ones out (a child's argv is visible to every user: see ``secret_env``)."""
    argv: list[str] = []
    for opt in options(type(settings)):
        if opt.secret and not secrets:
            continue
        value = _value(settings, opt)
        if only_changed and value == opt.default:
            continue
        if opt.kind is bool:
            argv.append(opt.flag if value else "--no-" + opt.flag[2:])
        elif opt.kind is tuple:
            for item in value:
                argv += [opt.flag, str(item)]
        elif value is not None:
            argv += [opt.flag, str(value)]
    return argv


def _value(settings: Any, opt: Option) -> Any:
    value = settings
    for name in opt.path:
        value = getattr(value, name)
    return value


def secret_env(settings: Any) -> dict[str, str]:
    """The ``PDSERVE_*`` variables that give a child the secret settings ``to_argv(...,
    secrets=False)`` leaves out (the ones that are set)."""
    env = {}
    for opt in options(type(settings)):
        value = _value(settings, opt)
        if opt.secret and value is not None:
            env[opt.env] = str(value)
    return env


# -- the environment --------------------------------------------------------------------------


def env_names(classes: Iterable[type]) -> set[str]:
    """Every ``PDSERVE_*`` variable the given settings classes read."""
    return {opt.env for cls in classes for opt in options(cls)}


def warn_unknown_env(known: set[str], environ: dict[str, str] | None = None) -> list[str]:
    """Log a warning for each ``PDSERVE_*`` variable no pdserve command reads; returns them."""
    environ = os.environ if environ is None else environ
    unknown = sorted(n for n in environ if n.startswith(ENV_PREFIX) and n not in known)
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        logger.warning("%s is not a pdserve setting and is ignored%s", name, hint)
    return unknown
