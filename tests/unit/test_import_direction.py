"""Dependencies point one way (docs/architecture.md, "Layers"): every import of every module,
at the top or inside a function, is checked against the rules below. Everything but the
engine, the workers and the kernels is free of torch, transformers and triton; the engine
and the plain-type layers are free of gRPC; nothing imports the commands; and nothing
imports pdserve by the folders' names (``services.``, ``kernels.``), which would load a
second copy of a module."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_WIRE = {"pdserve.core", "pdserve.settings", "pdserve.v1", "pdserve.wire"}
_SERVICE = _WIRE | {"pdserve.controlplane", "pdserve.runtime", "pdserve.kv"}
_WORKER = _SERVICE | {"pdserve.engine", "pdserve.worker"}

# package -> the other pdserve packages it may import
RULES: dict[str, set[str]] = {
    "pdserve.core": set(),
    "pdserve.settings": {"pdserve.core"},
    "pdserve.v1": set(),
    "pdserve.wire": {"pdserve.core", "pdserve.v1"},
    "pdserve.controlplane": {"pdserve.core", "pdserve.settings"},
    "pdserve.runtime": {"pdserve.core", "pdserve.settings", "pdserve.controlplane", "pdserve.v1"},
    "pdserve.kv": _SERVICE - {"pdserve.kv"},
    "pdserve.local": {"pdserve.core", "pdserve.settings"},
    "pdserve.kernels": set(),
    "pdserve.engine": {
        "pdserve.core",
        "pdserve.settings",
        "pdserve.kv",
        "pdserve.runtime",
        "pdserve.kernels",
    },
    "pdserve.worker": _WORKER - {"pdserve.worker"},
    "pdserve.prefill": _WORKER,
    "pdserve.decode": _WORKER,
    "pdserve.kvstore": _SERVICE,
    "pdserve.gateway": _SERVICE,
    "pdserve.loadgen": {"pdserve.core", "pdserve.settings"},
    "pdserve.planner": {
        "pdserve.core",
        "pdserve.settings",
        "pdserve.controlplane",
        "pdserve.runtime",
        "pdserve.loadgen",
    },
}
# The harness of tests and benchmarks may use any layer; no layer may use it.
RULES["pdserve.testing"] = set(RULES)
TORCH_FREE = set(RULES) - {
    "pdserve.testing",
    "pdserve.kernels",
    "pdserve.engine",
    "pdserve.worker",
    "pdserve.prefill",
    "pdserve.decode",
}
HEAVY = {"torch", "transformers", "triton"}
GRPC_FREE = {
    "pdserve.core",
    "pdserve.settings",
    "pdserve.controlplane",
    "pdserve.local",
    "pdserve.loadgen",
    "pdserve.engine",
    "pdserve.kernels",
}
# The commands (pdserve.cli, .up, .status: services/*.py) may import anything; nothing
# imports them. The generated code of pdserve.v1 is not checked.
GENERATED = "services/v1/"


def module_name(rel: str) -> str:
    """``services/gateway/router.py`` -> ``pdserve.gateway.router`` (and kernels/ ->
    pdserve.kernels)."""
    parts = rel.removesuffix(".py").split("/")
    top = ["pdserve"] if parts[0] == "services" else ["pdserve", "kernels"]
    return ".".join(top + parts[1:]).removesuffix(".__init__")


def package_of(module: str) -> str | None:
    """The RULES package holding ``module``, "command" for pdserve's top-level modules, or
    None outside pdserve."""
    for package in sorted(RULES, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    if module.startswith("pdserve.") and module.count(".") == 1:
        return "command"
    return None


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


def _forbidden(package: str, target: str) -> bool:
    top = target.split(".")[0]
    target_package = package_of(target)
    return (
        top in ("services", "kernels")
        or (top in HEAVY and package in TORCH_FREE)
        or (top == "grpc" and package in GRPC_FREE)
        or target_package == "command"
        or (target_package not in (None, package) and target_package not in RULES[package])
    )


def import_violations(root: Path) -> list[str]:
    """``file:line: package imports target`` for every import the rules forbid."""
    bad = []
    for path in sorted([*root.glob("services/**/*.py"), *root.glob("kernels/**/*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(GENERATED):
            continue
        package = package_of(module_name(rel))
        if package in (None, "command"):
            continue
        for line, target in imports_of(path):
            if _forbidden(package, target):
                bad.append(f"{rel}:{line}: {package} imports {target}")
    return bad


def old_name_imports(root: Path) -> list[str]:
    """Imports of pdserve by its folders' names anywhere in the tree (tests and bench too)."""
    bad = []
    for folder in ("services", "kernels", "tests", "bench", "deploy", "docker"):
        for path in sorted((root / folder).rglob("*.py")):
            for line, target in imports_of(path):
                if target.split(".")[0] in ("services", "kernels"):
                    bad.append(f"{path.relative_to(root)}:{line}: imports {target}")
    return bad


def test_every_package_imports_only_what_its_layer_may():
    assert import_violations(ROOT) == []


def test_nothing_imports_pdserve_by_its_folder_names():
    assert old_name_imports(ROOT) == []


def test_every_package_is_covered_by_a_rule():
    for init in ROOT.glob("services/*/__init__.py"):
        name = module_name(init.relative_to(ROOT).as_posix())
        assert name in RULES, f"{name} has no import rule"


def test_a_forbidden_import_is_caught(tmp_path):
    for folder in ("services", "kernels"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("v1"))
    added = {
        "services/gateway/requests.py": "import torch\n",
        "services/kvstore/store.py": "def f():\n    from pdserve.engine import LLM\n",
        "services/core/model.py": "from pdserve.gateway.router import Router\n",
        "services/engine/llm.py": "from pdserve.up import main\n",
        "services/engine/sequence.py": "import grpc\n",
        "services/settings/flags.py": "from pdserve.runtime.rpc import aio_channel\n",
        "services/kv/blocks.py": "from services.kv.hashing import BlockHash\n",
    }
    for rel, code in added.items():
        with open(tmp_path / rel, "a") as f:
            f.write(code)
    found = import_violations(tmp_path)
    assert len(found) == len(added), found
    assert any("services/gateway/requests.py" in v and "imports torch" in v for v in found)
    assert any("pdserve.kvstore imports pdserve.engine" in v for v in found)
    assert any("pdserve.core imports pdserve.gateway.router" in v for v in found)
    assert any("pdserve.engine imports pdserve.up" in v for v in found)
    assert any("pdserve.engine imports grpc" in v for v in found)
    assert any("pdserve.settings imports pdserve.runtime.rpc" in v for v in found)
    assert any("pdserve.kv imports services.kv.hashing" in v for v in found)
