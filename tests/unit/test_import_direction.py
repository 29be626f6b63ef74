"""Dependencies point one way (docs/architecture.md, "Layers"): every import of every module,
at the top or inside a function, is checked against the rules below. The gateway, the
kvstore, the bench client and ``services.common`` never import torch, transformers or
triton, nor the engine."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# package -> the other pdserve packages it may import
RULES: dict[str, set[str]] = {
    "services.common": set(),
    "kernels": set(),
    "services.engine": {"services.common", "kernels"},
    "services.worker": {"services.common", "services.engine"},
    "services.prefill": {"services.common", "services.engine", "services.worker"},
    "services.decode": {"services.common", "services.engine", "services.worker"},
    "services.kvstore": {"services.common"},
    "services.gateway": {"services.common"},
    "services.bench": {"services.common"},
}
TORCH_FREE = {"services.common", "services.kvstore", "services.gateway", "services.bench"}
HEAVY = {"torch", "transformers", "triton"}
# The commands (services/cli.py, up.py, status.py) may import anything; nothing imports them.
GENERATED = "services/common/proto"


def package_of(module: str) -> str | None:
    """The RULES package holding ``module``, or "command" for services' top-level modules."""
    for package in sorted(RULES, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    if module.startswith("services.") and module.count(".") == 1:
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


def import_violations(root: Path) -> list[str]:
    """``file:line: package imports target`` for every import the rules forbid."""
    bad = []
    for path in sorted([*root.glob("services/**/*.py"), *root.glob("kernels/**/*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(GENERATED):
            continue
        package = package_of(rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__"))
        if package in (None, "command"):
            continue
        for line, target in imports_of(path):
            top = target.split(".")[0]
            target_package = package_of(target)
            if (
                top in HEAVY
                and package in TORCH_FREE
                or target_package == "command"
                or (target_package not in (None, package) and target_package not in RULES[package])
            ):
                bad.append(f"{rel}:{line}: {package} imports {target}")
    return bad


def test_every_package_imports_only_what_its_layer_may():
    assert import_violations(ROOT) == []


def test_every_package_is_covered_by_a_rule():
    packages = {p.parent for p in ROOT.glob("services/*/__init__.py")}
    for package in packages:
        name = f"services.{package.name}"
        assert name in RULES, f"{name} has no import rule"


def test_a_forbidden_import_is_caught(tmp_path):
    for folder in ("services", "kernels"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("proto"))
    added = {
        "services/gateway/requests.py": "import torch\n",
        "services/kvstore/store.py": "def f():\n    from services.engine import LLM\n",
        "services/common/model.py": "from services.gateway.router import Router\n",
        "services/engine/llm.py": "from services.up import main\n",
    }
    for rel, code in added.items():
        with open(tmp_path / rel, "a") as f:
            f.write(code)
    found = import_violations(tmp_path)
    assert len(found) == 4
    assert any("services/gateway/requests.py" in v and "imports torch" in v for v in found)
    assert any("services.kvstore imports services.engine" in v for v in found)
    assert any("services.common imports services.gateway.router" in v for v in found)
    assert any("services.engine imports services.up" in v for v in found)
