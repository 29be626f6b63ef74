"""The commands a markdown code block or code span shows, read as the shell would.

A command is a line of a ```sh / ```bash / ```shell block (the ``$ `` lines of a ```console
block; in a block with no language, a line that starts with a program in a ``bin/`` folder,
such as ``.venv/bin/pdserve``, or with ``python``), or a code span that starts with a
program tests/helpers/command_checks.py checks, followed by arguments. Read as the shell
would: ``\\`` continuations and quotes spanning lines, comments, ``NAME=value`` prefixes
(the command's environment), ``export``, variables set earlier in the block (``$TLS``
splits into words; ``$(...)`` is a value not known), redirections, and ``|``, ``&&``,
``;`` and ``&`` between commands. ``...`` in a command, and every code span, makes it a
fragment: a part of a command, whose required arguments may be missing.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable, Iterator

SHELL_BLOCKS = {"sh", "bash", "shell", "zsh", "console"}
PYTHON = re.compile(r"python(\d(\.\d+)?)?")
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
SEPARATORS = {"|", "||", "&", "&&", ";", ";;", "|&"}
UNKNOWN = (
    "<unknown>"  # a command substitution's value: a placeholder; a variable set to it is unset
)
PROGRAMS = ("pdserve", "make", "curl", "grpcurl", "bash")  # and python, and FILE.py / FILE.sh


@dataclasses.dataclass(frozen=True)
class Command:
    """One command as the shell would run it."""

    line: int
    words: tuple[str, ...]  # the program and its arguments
    env: tuple[tuple[str, str], ...] = ()
    fragment: bool = False

    def __str__(self) -> str:
        text = shlex.join(self.words)
        return f"`{text[:90]}{' ...' if len(text) > 90 else ''}`"


def block_commands(info: str, first_line: int, lines: list[str]) -> list[Command]:
    """The commands of a fenced block whose first line is ``first_line``."""
    if info not in SHELL_BLOCKS and info != "":
        return []

    def is_command(text: str) -> bool:
        if info == "console":
            return text.startswith("$ ")
        return bool(info) or _looks_run((text.split() or [""])[0])

    commands: list[Command] = []
    variables: dict[str, str] = {}
    exported: dict[str, str] = {}
    for line, text in _logical_lines(first_line, lines, is_command):
        if not is_command(text):
            continue
        text = text.removeprefix("$ ") if info == "console" else text
        commands += line_commands(line, text, variables, exported, fragment=False)
    return commands


def span_command(line: int, text: str) -> Command | None:
    """The command an inline code span shows, if it shows one: a program and arguments."""
    words = text.split()
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if len(words) < 2 or not is_program(words[0]):
        return None
    found = line_commands(line, text, {}, {}, fragment=True)
    return found[0] if found else None


def is_program(word: str) -> bool:
    """Whether ``word`` is a program whose commands are checked."""
    name = word.rsplit("/", 1)[-1]
    return (
        name in PROGRAMS
        or bool(PYTHON.fullmatch(name))
        or ("/" in word and word.endswith((".py", ".sh")))
    )


def _looks_run(program: str) -> bool:
    """In a block with no language, only a program in a bin/ folder or python: not output
    such as ``pdserve up: logs in ...``, nor a layout's ``services/cli.py  the command``."""
    return "bin/" in program or bool(PYTHON.fullmatch(program))


def _logical_lines(
    first_line: int, lines: list[str], is_command: Callable[[str], bool]
) -> Iterator[tuple[int, str]]:
    """(line, text): ``\\`` continuations joined, and a command's lines joined while a quote
    is open (not an output line's: "SmolLM2's" opens none)."""
    i = 0
    while i < len(lines):
        start, text = i, lines[i].strip()
        while i + 1 < len(lines) and (
            text.endswith("\\") or (is_command(text) and not _quotes_closed(text))
        ):
            i += 1
            text = text[:-1] + " " + lines[i] if text.endswith("\\") else text + "\n" + lines[i]
        i += 1
        if text.strip():
            yield first_line + start, text.strip()


def _quotes_closed(text: str) -> bool:
    try:
        shlex.split(_strip_comment(text))
    except ValueError:
        return False
    return True


def _strip_comment(text: str) -> str:
    """The line without a ``#`` comment (one that starts a word, outside quotes)."""
    quote, i = None, 0
    while i < len(text):
        char = text[i]
        if char == "\\" and quote != "'":
            i += 2  # an escaped character
            continue
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i]
        i += 1
    return text


def line_commands(
    line: int, text: str, variables: dict[str, str], exported: dict[str, str], fragment: bool
) -> list[Command]:
    """The commands of one logical line; ``variables`` and ``exported`` (the block's so far)
    are read and updated by its assignments and ``export``."""
    text = _without_substitutions(_expand(_strip_comment(text), variables))
    text = re.sub(r"(?<=\s)\d*>>?&?\s*\S+", " ", text)  # redirections: 2>&1, > out.txt
    lexer = shlex.shlex(text, posix=True, punctuation_chars="|&;")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    commands = []
    for segment in _segments(tokens):
        env = {}
        while segment and ASSIGNMENT.match(segment[0]):
            name, _, value = segment.pop(0).partition("=")
            env[name] = value
        if segment[:1] == ["export"]:
            for word in segment[1:]:
                name, eq, value = word.partition("=")
                exported[name] = value if eq else variables.get(name, "")
                variables[name] = exported[name]
            continue
        if not segment:
            variables.update(env)
            continue
        while segment and segment[0] in ("exec", "time", "nohup", "sudo"):
            segment.pop(0)
        elided = "..." in segment or "…" in segment
        words = tuple(w for w in segment if w not in ("...", "…"))
        if words:
            full_env = tuple((k, v) for k, v in {**exported, **env}.items() if UNKNOWN not in v)
            commands.append(Command(line, words, full_env, fragment or elided))
    return commands


def _without_substitutions(text: str) -> str:
    """Each ``$(...)`` (nested, quoted parentheses and all) replaced by ``UNKNOWN``."""
    out, i = [], 0
    while (start := text.find("$(", i)) >= 0:
        depth, quote, j = 0, None, start + 1
        while j < len(text):
            char = text[j]
            if quote:
                quote = None if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char == "(":
                depth += 1
            elif char == ")":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        out += [text[i:start], UNKNOWN]
        i = j + 1
    return "".join(out) + text[i:]


def _expand(text: str, variables: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` of the variables set earlier in the block; others stay."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def _segments(tokens: list[str]) -> Iterator[list[str]]:
    segment: list[str] = []
    for token in tokens:
        if token in SEPARATORS:
            if segment:
                yield segment
            segment = []
        else:
            segment.append(token)
    if segment:
        yield segment
