"""What each command the docs show is checked against (the commands:
tests/helpers/shell_commands.py).

- ``pdserve ...`` (any path ending in ``bin/pdserve``), ``python -m pdserve.X`` /
  ``bench.X`` / ``tests.X`` and ``python FILE.py``: the real entry point, parsed only
  (tests/helpers/parse_only.py); a fragment's required arguments may be missing, and a
  placeholder value (``--http-port P``, ``<N>``) is replaced by one its flag takes. A file
  that reads no arguments is not run: it would do its work.
- ``make TARGET VAR=...``: the target exists, the Makefile uses each variable, and the
  recipe lines that use a variable given are checked as commands with it expanded (``make
  up ARGS="--prefill 2"`` checks ``.venv/bin/pdserve up --prefill 2``; pytest's own
  arguments are not checked).
- ``curl``: the URL's path is a route of the gateway's REST app (``/metrics`` anywhere), and
  a ``-d`` body is JSON its route's request model accepts.
- ``grpcurl``: the method is an rpc of a service in protos/ (or the standard health and
  reflection services), and a ``-d`` body is JSON of the method's request message.
- a ``.sh`` script: it exists, and the line that passes ``"$@"`` on is checked with the
  arguments; ``kubectl ... -- CMD``: CMD; ``helm install NAME CHART``: the chart exists.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.machinery
import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from tests.helpers.parse_only import Entry, is_placeholder, parse_all
from tests.helpers.shell_commands import ASSIGNMENT, PYTHON, Command, is_program, line_commands

PROJECT_MODULES = ("pdserve", "bench", "tests")
URL = re.compile(r"\w+://|[\w.\-]+:\d+(/|$)")  # http://host/path, or host:port/path
# A file that mentions none of these takes no arguments: running it would do its work.
PARSES = ("argparse", "ArgumentParser", "parse_args", "parse_settings", "run_service", "argv")
STANDARD_GRPC = {
    "grpc.health.v1.Health": {"Check", "Watch"},
    "grpc.reflection.v1alpha.ServerReflection": {"ServerReflectionInfo"},
    "grpc.reflection.v1.ServerReflection": {"ServerReflectionInfo"},
}


class CommandChecker:
    """Checks commands against the repository at ``root``: what is wrong with each."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def problems(self, commands: list[Command]) -> list[tuple[int, str]]:
        """(index of a command, what is wrong with it), every entry parsed in one batch."""
        found: list[tuple[int, str]] = []
        to_parse: list[tuple[int, Entry]] = []
        for index, cmd in enumerate(commands):
            for item in self.check(cmd):
                if isinstance(item, Entry):
                    to_parse.append((index, item))
                else:
                    found.append((index, item))
        errors = parse_all([entry for _, entry in to_parse], self.root)
        found += [(i, error) for (i, _), error in zip(to_parse, errors, strict=True) if error]
        return sorted(found)

    def check(self, cmd: Command) -> Iterator[str | Entry]:
        """Problems found at once, and the entries to parse."""
        program, args = cmd.words[0], list(cmd.words[1:])
        name = program.rsplit("/", 1)[-1]
        if name == "pdserve":
            if not (args and is_placeholder(args[0])):
                yield Entry("pdserve", "", tuple(args), cmd.env, cmd.fragment)
        elif PYTHON.fullmatch(name):
            yield from self._python(cmd, args)
        elif name == "make":
            yield from self._make(cmd, args)
        elif name == "curl":
            yield from self._curl(args)
        elif name == "grpcurl":
            yield from self._grpcurl(args)
        elif name in ("bash", "sh") and args and not args[0].startswith("-"):
            yield from self._script(cmd, args[0], args[1:])
        elif program.endswith((".py", ".sh")):
            yield from self._script(cmd, program, args)
        elif name in ("kubectl", "docker") and "--" in args:
            inner = args[args.index("--") + 1 :]
            if inner:
                yield from self.check(dataclasses.replace(cmd, words=tuple(inner)))
        elif name == "helm" and args[:1] in (["install"], ["upgrade"], ["template"]):
            positional = [a for a in args[1:] if not a.startswith("-")]
            chart = positional[1] if len(positional) > 1 else None
            local = chart and "/" in chart and (self.root / chart.split("/")[0]).exists()
            if local and not (self.root / chart).exists():
                yield f"no chart {chart} in the repository"

    # -- python -------------------------------------------------------------------------

    def _python(self, cmd: Command, args: list[str]) -> Iterator[str | Entry]:
        while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
            option = args.pop(0)
            if option in ("-X", "-W") and args:
                args.pop(0)
        if not args or args[0] == "-c":
            return
        if args[0] == "-m":
            if len(args) < 2 or args[1].split(".")[0] not in PROJECT_MODULES:
                return  # pip, venv, pytest: not the project's
            yield from self._module(cmd, args[1], args[2:])
            return
        yield from self._script(cmd, args[0], args[1:])

    def _module(self, cmd: Command, name: str, args: list[str]) -> Iterator[str | Entry]:
        spec = module_spec(name)
        if spec is None or spec.origin is None:
            yield f"no module {name}"
            return
        if spec.submodule_search_locations is not None:
            main = module_spec(name + ".__main__")
            if main is None:
                yield f"{name} is a package without __main__: python -m cannot run it"
                return
            spec = main
        yield from self._run_if_parses(
            Path(spec.origin), Entry("module", name, tuple(args), cmd.env, cmd.fragment)
        )

    def _script(self, cmd: Command, path: str, args: list[str]) -> Iterator[str | Entry]:
        if path.startswith(("/", "~", "$")) or is_placeholder(path):
            return
        file = self.root / path
        if not file.is_file():
            yield f"no file {path} in the repository"
            return
        if file.suffix == ".py":
            entry = Entry("script", path, tuple(args), cmd.env, cmd.fragment)
            yield from self._run_if_parses(file, entry)
        elif file.suffix == ".sh":
            yield from self._shell_script(cmd, file, args)

    def _run_if_parses(self, file: Path, entry: Entry) -> Iterator[str | Entry]:
        """Only a file that parses arguments is run: one that does not would do its work."""
        if any(word in file.read_text() for word in PARSES):
            yield entry
        elif entry.argv:
            yield f"{file.relative_to(self.root)} reads no arguments, but is given some"

    def _shell_script(self, cmd: Command, file: Path, args: list[str]) -> Iterator[str | Entry]:
        """A wrapper's ``exec ... "$@"`` line, checked with the arguments given."""
        for text in file.read_text().splitlines():
            if '"$@"' in text and not text.lstrip().startswith("#"):
                words = [w for w in shlex.split(text) if w != "exec"]
                words = [arg for w in words for arg in (args if w == "$@" else [w])]
                if words and is_program(words[0]):
                    yield from self.check(dataclasses.replace(cmd, words=tuple(words)))
                return

    # -- make ---------------------------------------------------------------------------

    def _make(self, cmd: Command, args: list[str]) -> Iterator[str | Entry]:
        makefile = _makefile(self.root)
        overrides = dict(a.split("=", 1) for a in args if ASSIGNMENT.match(a))
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        for name in overrides:
            if name not in makefile.used:
                yield f"the Makefile does not use {name}"
        for target in targets:
            if target not in makefile.recipes:
                yield f"no make target {target!r} (targets: {', '.join(sorted(makefile.recipes))})"
                continue
            for recipe in makefile.recipes[target]:
                if any(f"$({name})" in recipe or f"${{{name}}}" in recipe for name in overrides):
                    text = makefile.expand(recipe, overrides).lstrip("@-")
                    for inner in line_commands(cmd.line, text, {}, {}, cmd.fragment):
                        yield from self.check(dataclasses.replace(inner, env=cmd.env + inner.env))

    # -- curl and grpcurl ----------------------------------------------------------------

    def _curl(self, args: list[str]) -> Iterator[str]:
        options = _options(args, CURL_VALUES)
        urls = options.get("--url", []) + [a for a in options[""] if URL.match(a)]
        if not urls:
            return
        path = urlparse(urls[0] if "://" in urls[0] else "http://" + urls[0]).path or "/"
        body = next((v for k in CURL_DATA for v in options.get(k, [])), None)
        method = (options.get("-X") or options.get("--request") or ["POST" if body else "GET"])[0]
        if path == "/metrics":
            return
        routes = _rest_routes()
        if (method.upper(), path) not in routes:
            listed = ", ".join(f"{m} {p}" for m, p in sorted(routes))
            yield f"the gateway's REST API has no {method.upper()} {path} (it has {listed})"
            return
        if body is not None and not body.startswith("@"):
            yield from _body_problems(body, routes[(method.upper(), path)])

    def _grpcurl(self, args: list[str]) -> Iterator[str]:
        options = _options(args, GRPCURL_VALUES)
        positional = options[""]
        if {"list", "describe"} & set(positional) or len(positional) < 2:
            return
        method = positional[-1].replace("/", ".")
        service, _, rpc = method.rpartition(".")
        services = {**proto_services(self.root), **STANDARD_GRPC}
        if service not in services:
            yield f"no gRPC service {service} in protos/ (services: {', '.join(sorted(services))})"
        elif rpc not in services[service]:
            yield f"{service} has no rpc {rpc} (it has {', '.join(sorted(services[service]))})"
        elif "-d" in options and not options["-d"][0].startswith("@"):
            yield from _message_problems(options["-d"][0], service, rpc)


CURL_DATA = ("-d", "--data", "--data-raw", "--data-binary", "--json")
CURL_VALUES = {
    *CURL_DATA,
    *("-H", "--header", "-X", "--request", "-o", "--output", "-u", "--user", "-A"),
    *("-m", "--max-time", "-w", "--write-out", "--url", "--cacert", "--cert", "--key"),
    *("-b", "-c", "-e", "-F", "--form", "-T", "--connect-timeout", "--retry"),
}
GRPCURL_VALUES = {
    *("-d", "-H", "-rpc-header", "-reflect-header", "-import-path", "-proto", "-protoset"),
    *("-cacert", "-cert", "-key", "-servername", "-authority", "-max-time", "-format"),
    *("-connect-timeout", "-keepalive-time", "-max-msg-sz", "-user-agent", "-unix"),
}


def _options(args: list[str], takes_value: set[str]) -> dict[str, list[str]]:
    """Option -> its values; "" -> the positional arguments."""
    found: dict[str, list[str]] = {"": []}
    words = iter(args)
    for word in words:
        name, eq, value = word.partition("=")
        if word.startswith("-") and name in takes_value:
            found.setdefault(name, []).append(value if eq else next(words, ""))
        elif not word.startswith("-"):
            found[""].append(word)
    return found


@functools.cache
def _rest_routes() -> dict[tuple[str, str], type | None]:
    """(method, path) of the gateway's REST app -> the route's request body model."""
    from pdserve.gateway.openai_api import Served, create_app
    from pdserve.gateway.requests import ModelLimits

    app = create_app(Served(None, None, ModelLimits(2048, 512), "model"))
    routes: dict[tuple[str, str], type | None] = {}
    for route in app.routes:
        dependant = getattr(route, "dependant", None)
        body = (
            dependant.body_params[0].field_info.annotation
            if dependant and dependant.body_params
            else None
        )
        for method in getattr(route, "methods", ()):
            routes[(method, route.path)] = body
    return routes


def _body_problems(text: str, model: type | None) -> Iterator[str]:
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        yield f"the -d body is not JSON: {error}"
        return
    if model is not None:
        from pydantic import ValidationError

        try:
            model.model_validate(body)
        except ValidationError as error:
            yield f"the -d body is not a valid {model.__name__}: {_first_error(error)}"


def _first_error(error) -> str:
    first = error.errors()[0]
    return f"{'.'.join(map(str, first['loc']))}: {first['msg']}"


@functools.cache
def proto_services(root: Path) -> dict[str, set[str]]:
    """``package.Service`` -> its rpc names, read from protos/**/*.proto."""
    services: dict[str, set[str]] = {}
    for proto in sorted(root.glob("protos/**/*.proto")):
        text = re.sub(r"//.*", "", proto.read_text())
        package = re.search(r"^\s*package\s+([\w.]+)\s*;", text, re.M)
        prefix = package.group(1) + "." if package else ""
        for name, body in re.findall(r"\bservice\s+(\w+)\s*\{(.*?)\n\}", text, re.S):
            services[prefix + name] = set(re.findall(r"\brpc\s+(\w+)\s*\(", body))
    return services


def _message_problems(text: str, service: str, rpc: str) -> Iterator[str]:
    """A grpcurl ``-d`` body against the request message of the generated code."""
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        yield f"the -d body is not JSON: {error}"
        return
    if not service.startswith("pdserve."):
        return
    import importlib
    import pkgutil

    from google.protobuf import descriptor_pool, json_format, message_factory

    import pdserve.v1 as generated

    for module in pkgutil.iter_modules(generated.__path__):
        if module.name.endswith("_pb2"):
            importlib.import_module(f"pdserve.v1.{module.name}")
    try:
        method = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(rpc)
    except KeyError:
        yield f"services/v1 has no {service}/{rpc}: regenerate it (python -m pdserve.wire.protogen)"
        return
    request = message_factory.GetMessageClass(method.input_type)()
    try:
        json_format.Parse(text, request)
    except json_format.ParseError as error:
        yield f"the -d body is not a {method.input_type.full_name}: {error}"


# -- the Makefile ---------------------------------------------------------------------------


@dataclasses.dataclass
class Makefile:
    """A Makefile's targets with their recipe lines, its variables, and the names it uses."""

    recipes: dict[str, list[str]]
    variables: dict[str, str]
    used: set[str]

    def expand(self, text: str, overrides: dict[str, str], depth: int = 0) -> str:
        """``$(NAME)`` as make would expand it (command-line values win)."""
        values = {**self.variables, **overrides}
        expanded = re.sub(r"\$[({](\w+)[)}]", lambda m: values.get(m.group(1), ""), text)
        return (
            expanded
            if expanded == text or depth > 8
            else self.expand(expanded, overrides, depth + 1)
        )


@functools.cache
def _makefile(root: Path) -> Makefile:
    text = (root / "Makefile").read_text()
    variables: dict[str, str] = {}
    recipes: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("\t"):
            current.append(line.strip())
            continue
        assignment = re.match(r"^(\w+)\s*(?:\?=|:=|::=|\+=|=)\s*(.*)$", line)
        if assignment:
            variables.setdefault(assignment.group(1), assignment.group(2).strip())
            continue
        rule = re.match(r"^([^\s#:=][^:=#]*?)\s*::?(?!=)", line)
        if rule:
            current = []
            for target in rule.group(1).split():
                recipes[target] = current
    used = set(re.findall(r"\$[({](\w+)[)}]", text)) | set(variables)
    makefile = Makefile(recipes, variables, used)
    expanded = {makefile.expand(t, {}): lines for t, lines in recipes.items()}
    return Makefile({t: r for t, r in expanded.items() if not t.startswith(".")}, variables, used)


def module_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """``name``'s spec, its packages searched without being imported (pdserve.engine's
    ``__init__`` imports torch); only a top-level package is imported."""
    parts = name.split(".")
    try:
        importlib.import_module(parts[0])
    except ImportError:
        return None
    spec = sys.modules[parts[0]].__spec__
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = _find_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    return spec


def _find_spec(name: str, path: list[str]) -> importlib.machinery.ModuleSpec | None:
    if name in sys.modules:
        return getattr(sys.modules[name], "__spec__", None)
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, path) if find else None
        if spec is not None:
            return spec
    return None
