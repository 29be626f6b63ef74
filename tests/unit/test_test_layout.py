"""The tests' own layout, checked on every import statement (at the top or inside a function):
no file under tests/ imports a test module (``tests.integration.*``, ``tests.unit.*``, a
``test_*`` or ``conftest`` module), so that what tests share lives in tests/helpers, or in
pdserve.testing where benchmarks share it too; and nothing under bench/ imports ``tests``."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_names(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything the file imports: ``from a.b import c``
    gives ``a.b.c``; a relative import is resolved against the file's folder."""
    package = path.relative_to(root).parent.parts
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return out


def is_test_module(name: str) -> bool:
    """Whether ``name`` is (or is inside) a test module or a conftest."""
    parts = name.split(".")
    return parts[:2] in (["tests", "integration"], ["tests", "unit"]) or any(
        part.startswith("test_") or part == "conftest" for part in parts
    )


def layout_violations(root: Path) -> list[str]:
    """``file:line: imports name`` for every import the layout forbids."""
    bad = []
    for path in sorted((root / "tests").rglob("*.py")):
        for line, name in imported_names(path, root):
            if is_test_module(name):
                bad.append(f"{path.relative_to(root)}:{line}: imports {name}")
    for path in sorted((root / "bench").rglob("*.py")):
        for line, name in imported_names(path, root):
            if name.split(".")[0] == "tests":
                bad.append(f"{path.relative_to(root)}:{line}: imports {name}")
    return bad


def test_no_test_module_imports_another_and_bench_imports_no_tests():
    assert layout_violations(ROOT) == []


def test_a_forbidden_import_is_caught(tmp_path):
    for folder in ("tests", "bench"):
        shutil.copytree(
            ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    # planted file -> (its one line, the name the check must report)
    planted = {
        "tests/integration/test_planted_a.py": (
            "from tests.integration.test_metrics import x",
            "tests.integration.test_metrics.x",
        ),
        "tests/integration/test_planted_b.py": (
            "def f(): from test_migration import metric",
            "test_migration.metric",
        ),
        "tests/unit/test_planted.py": (
            "import tests.unit.test_block_pool",
            "tests.unit.test_block_pool",
        ),
        "tests/integration/test_planted_c.py": (
            "from tests.integration import test_openai_api",
            "tests.integration.test_openai_api",
        ),
        "tests/helpers/planted.py": ("from .. import conftest", "tests.conftest"),
        "bench/planted.py": (
            "from tests.helpers.flags import ENGINE",
            "tests.helpers.flags.ENGINE",
        ),
    }
    for rel, (code, _) in planted.items():
        (tmp_path / rel).write_text(code + "\n")
    # Only what was planted counts: the tree copied may hold violations of its own.
    found = set(layout_violations(tmp_path)) - set(layout_violations(ROOT))
    assert sorted(found) == sorted(f"{rel}:1: imports {name}" for rel, (_, name) in planted.items())


def test_the_shared_helpers_pass():
    names = [
        "tests.helpers.clusters.running",
        "pdserve.testing.metrics.value",
        "tests.parse_only.Entry",
        "pdserve.testing.cluster",
    ]
    assert not any(is_test_module(n) for n in names)


def test_the_longest_first_files_exist():
    """tests/conftest.py's LONGEST_FIRST names files by path: a renamed one would silently
    lose its early start."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    (listed,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LONGEST_FIRST"
    ]
    assert listed and [p for p in listed if not (ROOT / p).is_file()] == []
