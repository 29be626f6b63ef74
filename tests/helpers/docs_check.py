"""What the docs (README.md, docs/*.md, bench/RESULTS.md) point at must exist.

``check(root, rel, text)`` reads one markdown file and returns every problem, each with its
file and line:

- every command it shows (tests/helpers/shell_commands.py) holds: it parses with the real
  parsers, its make target, REST route or gRPC method exists
  (tests/helpers/command_checks.py);
- every link to a file resolves (relative to the doc), and its ``#anchor`` is a heading
  of the target (GitHub's anchors); web links are not fetched;
- a code span that is a repository path (``services/engine/scheduler.py``, ``helm/pdserve/``,
  ``docs/*.md``; a first folder that is not the repository's makes it something else)
  exists, or is a path git ignores (an output such as ``bench/out``), and so does the
  path that starts a line of a block with no language (a layout listing);
- a code span that is a module (``pdserve.engine.scheduler``, ``bench.serving.compare``)
  is found without importing it (no torch), or names what its module defines, a proto
  service or message, or a string the code uses (a trace attribute: ``pdserve.worker.id``);
- every ``PDSERVE_*`` variable it names is one some pdserve command reads.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

from pdserve.settings.commands import known_env
from tests.helpers.command_checks import (
    PROJECT_MODULES,
    CommandChecker,
    module_spec,
    proto_services,
)
from tests.helpers.shell_commands import Command, block_commands, span_command

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/*.md", "bench/RESULTS.md")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
PATH = re.compile(r"[\w.\-]+(?:/[\w.\-*]*)+")
MODULE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
VARIABLE = re.compile(r"PDSERVE_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*[*<])")


@dataclasses.dataclass(frozen=True, order=True)
class Problem:
    """Something a doc shows that is not so."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclasses.dataclass(frozen=True)
class Markdown:
    """A markdown file split into fenced blocks, inline code spans and the prose around."""

    blocks: list[tuple[str, int, list[str]]]  # (language, first line, lines)
    spans: list[tuple[int, str]]  # (line, text)
    prose: str  # the text with blocks and spans blanked, lines kept
    anchors: set[str]


def doc_files(root: Path = ROOT) -> list[str]:
    """The docs, relative to ``root``."""
    found = {p.relative_to(root).as_posix() for pattern in DOCS for p in root.glob(pattern)}
    return sorted(found)


def check_all(root: Path = ROOT) -> list[Problem]:
    """Every problem of every doc; the commands of all of them parsed in one batch."""
    return check_many(root, {rel: (root / rel).read_text() for rel in doc_files(root)})


def check_many(root: Path, docs: dict[str, str]) -> list[Problem]:
    """Every problem of ``docs`` (path relative to ``root`` -> text)."""
    problems: list[Problem] = []
    commands: list[tuple[str, Command]] = []
    for rel, text in docs.items():
        md = read_markdown(text)
        problems += _link_problems(root, rel, md)
        problems += _reference_problems(root, rel, md)
        problems += [Problem(rel, line, msg) for line, msg in _variable_problems(text)]
        commands += [(rel, cmd) for cmd in _commands(md)]
    for i, message in CommandChecker(root).problems([cmd for _, cmd in commands]):
        rel, cmd = commands[i]
        problems.append(Problem(rel, cmd.line, f"{cmd}: {message}"))
    return sorted(set(problems))


def check(root: Path, rel: str, text: str) -> list[Problem]:
    """Every problem of one doc."""
    return check_many(root, {rel: text})


# -- reading markdown -----------------------------------------------------------------------


def read_markdown(text: str) -> Markdown:
    """Split ``text`` into its fenced blocks, code spans and prose."""
    lines = text.split("\n")
    blocks = []
    prose_lines = list(lines)
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        mark, indent = fence["fence"], len(fence["indent"])
        closing = re.compile(rf"^[ \t]*{re.escape(mark[0])}{{{len(mark)},}}\s*$")
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            j += 1
        body = [_dedent(line, indent) for line in lines[i + 1 : j]]
        blocks.append((fence["info"].lower(), i + 2, body))
        for k in range(i, min(j + 1, len(lines))):
            prose_lines[k] = ""
        i = j + 1
    prose = "\n".join(prose_lines)
    spans, blanked = _code_spans(prose)
    return Markdown(blocks, spans, blanked, _anchors(prose, text))


def _dedent(line: str, indent: int) -> str:
    return line[indent:] if not line[:indent].strip() else line.lstrip()


def _code_spans(prose: str) -> tuple[list[tuple[int, str]], str]:
    """CommonMark's code spans (they may run over lines, not over a blank one), and the
    prose with each blanked."""
    runs = [(m.start(), m.end()) for m in re.finditer(r"`+", prose)]
    spans: list[tuple[int, str]] = []
    blanked = list(prose)
    i = 0
    while i < len(runs):
        start, end = runs[i]
        close = next(
            (
                j
                for j in range(i + 1, len(runs))
                if runs[j][1] - runs[j][0] == end - start and "\n\n" not in prose[end : runs[j][0]]
            ),
            None,
        )
        if close is None:
            i += 1
            continue
        content = prose[end : runs[close][0]].replace("\n", " ")
        if content.startswith(" ") and content.endswith(" ") and content.strip():
            content = content[1:-1]
        spans.append((prose.count("\n", 0, start) + 1, content))
        for k in range(start, runs[close][1]):
            if blanked[k] != "\n":
                blanked[k] = " "
        i = close + 1
    return spans, "".join(blanked)


def _anchors(prose: str, text: str) -> set[str]:
    """GitHub's heading anchors (a repeated one gets -1, -2, ...) and explicit ids."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for line in prose.split("\n"):
        heading = HEADING.match(line)
        if not heading:
            continue
        slug = slugify(heading.group(1))
        anchors.add(slug if slug not in counts else f"{slug}-{counts[slug]}")
        counts[slug] = counts.get(slug, 0) + 1
    anchors |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return anchors


def slugify(heading: str) -> str:
    """GitHub's anchor of a heading."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _line_of(prose: str, offset: int) -> int:
    return prose.count("\n", 0, offset) + 1


# -- links and references ---------------------------------------------------------------------


def _link_problems(root: Path, rel: str, md: Markdown) -> list[Problem]:
    problems = []
    found = [(m.start(), m.group(1)) for m in LINK.finditer(md.prose)]
    found += [(m.start(), m.group(1)) for m in REFERENCE.finditer(md.prose)]
    for offset, target in found:
        if re.match(r"[a-z][a-z0-9+.\-]*:", target):  # https:, mailto:
            continue
        message = _link_problem(root, rel, md, unquote(target))
        if message:
            problems.append(Problem(rel, _line_of(md.prose, offset), message))
    return problems


def _link_problem(root: Path, rel: str, md: Markdown, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    if not path:
        return None if anchor in md.anchors else f"link to #{anchor}: no such heading here"
    file = (root / rel).parent / path
    if not file.exists():
        return f"link to {target}: no file {path} (relative to {rel})"
    if anchor and file.suffix == ".md" and anchor not in read_markdown(file.read_text()).anchors:
        return f"link to {target}: {path} has no heading #{anchor}"
    return None


def _reference_problems(root: Path, rel: str, md: Markdown) -> list[Problem]:
    problems = []
    paths: list[tuple[int, str]] = []
    for line, text in md.spans:
        word = text.strip().rstrip(".,;:")
        word = re.sub(r":\d+(-\d+)?$", "", word)  # file.py:123
        if PATH.fullmatch(word) and (root / word.split("/")[0]).exists():
            paths.append((line, word))
        elif (
            MODULE.fullmatch(word)
            and word.split(".")[0] in PROJECT_MODULES
            and not _module_resolves(root, word)
        ):
            problems.append(Problem(rel, line, f"`{word}`: no such module or name"))
    for language, first, lines in md.blocks:
        if language:
            continue
        for k, text in enumerate(lines):
            word = (text.split() or [""])[0].rstrip(".,;:")
            if PATH.fullmatch(word) and (root / word.split("/")[0]).is_dir():
                paths.append((first + k, word))
    missing = [(line, p) for line, p in paths if not _path_exists(root, p)]
    ignored = _git_ignored(root, tuple(p for _, p in missing))
    problems += [
        Problem(rel, line, f"`{p}`: no such file or folder in the repository")
        for line, p in missing
        if p not in ignored
    ]
    return problems


def _path_exists(root: Path, path: str) -> bool:
    if "*" in path:
        return any(root.glob(path))
    return (root / path).exists()


def _git_ignored(root: Path, paths: tuple[str, ...]) -> set[str]:
    """Those of ``paths`` that git ignores: outputs a run makes, such as bench/out (asked
    as a file and as a folder, since a missing path is neither)."""
    if not paths:
        return set()
    asked = [form for p in paths for form in (p.rstrip("/"), p.rstrip("/") + "/")]
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        input="\n".join(asked),
        capture_output=True,
        text=True,
        cwd=root,
    )
    ignored = {line.rstrip("/") for line in done.stdout.split()}
    return {p for p in paths if p.rstrip("/") in ignored}


def _module_resolves(root: Path, name: str) -> bool:
    """A module found without importing it, a name its module defines, or a proto's."""
    if module_spec(name) is not None:
        return True
    parent, _, attribute = name.rpartition(".")
    spec = module_spec(parent)
    origin = spec.origin if spec is not None else None
    if origin and origin.endswith(".py") and attribute in defined_names(Path(origin)):
        return True
    protos = proto_services(root)
    proto_names = set(protos) | {f"{s}.{rpc}" for s, rpcs in protos.items() for rpc in rpcs}
    quoted = (f'"{name}"', f"'{name}'")
    return (
        name in proto_names
        or name in _proto_messages(root)
        or any(q in _code_strings(root) for q in quoted)
    )


@functools.cache
def _code_strings(root: Path) -> str:
    """Every string literal of the package's code, quoted, in one text: a dotted name that
    is one (a trace attribute such as ``pdserve.worker.id``) is what the code names."""
    texts = [p.read_text() for p in sorted(root.glob("services/**/*.py"))]
    return "\n".join(re.findall(r"\"[^\"\n]*\"|'[^'\n]*'", "\n".join(texts)))


@functools.cache
def _proto_messages(root: Path) -> set[str]:
    names = set()
    for proto in root.glob("protos/**/*.proto"):
        text = proto.read_text()
        package = re.search(r"^\s*package\s+([\w.]+)\s*;", text, re.M)
        prefix = package.group(1) + "." if package else ""
        names |= {prefix + m for m in re.findall(r"\b(?:message|enum)\s+(\w+)", text)}
    return names


def defined_names(file: Path) -> set[str]:
    """The names a Python file defines or imports at its top level."""
    names: set[str] = set()
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _variable_problems(text: str) -> list[tuple[int, str]]:
    known = known_env()
    return [
        (_line_of(text, m.start()), f"{m.group(0)}: no pdserve command reads this variable")
        for m in VARIABLE.finditer(text)
        if m.group(0) not in known
    ]


def _commands(md: Markdown) -> list[Command]:
    found = []
    for language, first, lines in md.blocks:
        found += block_commands(language, first, lines)
    for line, text in md.spans:
        cmd = span_command(line, text)
        if cmd is not None:
            found.append(cmd)
    return found


def report(problems: list[Problem]) -> str:
    """One line per problem, for an assertion message."""
    return f"{len(problems)} problems in the docs:\n" + "\n".join(map(str, problems))
