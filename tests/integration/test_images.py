"""The container images (Dockerfile) as far as they can be checked without a container engine:
their install steps are Makefile targets that exist, what they copy exists and is not
ignored, they agree with the chart (variants, user, cache directory), and the slim image's
packages are enough for the gateway and the kvstore to serve (the wheel itself:
test_packaging.py)."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import shlex
import signal
import subprocess
import sys
import tomllib

import pytest

from tests.helpers.helm_chart import CHART, of_kind, render
from tests.helpers.import_trace import LIGHT_SERVICES, imported_modules

ROOT = CHART.parents[1]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENGINE_ONLY = PYPROJECT["tool"]["pdserve"]["engine-only"]


def _load_slim_requirements():
    """docker/slim_requirements.py, by path (``docker`` is also a PyPI package's name)."""
    path = ROOT / "docker" / "slim_requirements.py"
    spec = importlib.util.spec_from_file_location("slim_requirements", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_slim = _load_slim_requirements()
requirement_name, slim_requirements = _slim.requirement_name, _slim.slim_requirements


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[str]:
    return [args.split()[-1] for word, args in instructions() if word == "FROM" and " AS " in args]


def test_every_make_target_the_dockerfile_runs_exists():
    runs = [args for word, args in instructions() if word == "RUN" and args.startswith("make ")]
    assert len(runs) >= 3
    for run in runs:
        argv = shlex.split(run)
        done = subprocess.run(
            ["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, f"{run}: {done.stderr}"
        assert "pip install" in done.stdout, done.stdout


def ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)


def test_what_the_dockerfile_copies_exists_and_is_sent():
    copies = [args for word, args in instructions() if word == "COPY"]
    local = [c for c in copies if not c.startswith("--from=")]
    assert local
    for copy in local:
        *sources, _ = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not ignored(source.rstrip("/")), f"{source} is in .dockerignore"
    # Everything the installs read is sent: the package, its data, the Makefile's inputs.
    for needed in (
        "services",
        "kernels/csrc",
        "constraints/cpu.txt",
        "docker/slim_requirements.py",
    ):
        assert not ignored(needed), needed
    for copy in copies:
        if copy.startswith("--from="):
            assert copy.split()[0].removeprefix("--from=") in stages(), copy


def test_the_images_are_the_charts_variants():
    schema = json.loads((CHART / "values.schema.json").read_text())
    variants = schema["properties"]["image"]["properties"]["variant"]["enum"]
    assert {v or "engine" for v in variants} <= set(stages())
    deployment = of_kind(render(), "Deployment")["t-pdserve-decode"]
    spec = deployment["spec"]["template"]["spec"]
    (cache,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "cache"]
    env = " ".join(args for word, args in instructions() if word == "ENV")
    assert f"PDSERVE_HOME={cache['mountPath']}" in env
    users = {args for word, args in instructions() if word == "USER"}
    assert users == {str(spec["securityContext"]["runAsUser"])}
    # The engine stage is last: a plain `docker build` makes the CPU image.
    assert stages()[-1] == "engine"


def test_the_slim_requirements_leave_out_only_the_engine():
    slim = {requirement_name(r) for r in slim_requirements()}
    every = {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert every - slim == {requirement_name(n) for n in ENGINE_ONLY}
    assert {"grpcio", "fastapi", "tokenizers", "redis"} <= slim


# Runs a pdserve command where the engine-only packages cannot be imported.
_WITHOUT_ENGINE = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Slim(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the slim image)")
sys.meta_path.insert(0, Slim())
from pdserve.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(("command", "args", "expect"), LIGHT_SERVICES)
def test_slim_services_serve_without_the_engine_packages(
    launcher, tiny_chat_llama_path, command, args, expect
):
    blocked = {requirement_name(n).replace("-", "_") for n in ENGINE_ONLY}
    argv = [sys.executable, "-X", "importtime", "-c", _WITHOUT_ENGINE, ",".join(sorted(blocked))]
    argv += [command, "--port", "0", *args]
    if command == "gateway":
        argv += ["--model", str(tiny_chat_llama_path)]
    child = launcher.start_ready(command, argv, expect, timeout=60)
    child.signal(signal.SIGTERM)
    assert child.proc.wait(30) == 0, child.log_tail()
    modules = imported_modules(child.log_text())
    assert "grpc" in modules and not {m.partition(".")[0] for m in modules} & blocked
