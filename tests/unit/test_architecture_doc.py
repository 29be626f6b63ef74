"""docs/architecture.md against the layout: its layer table says what
tests/unit/test_import_direction.py's RULES say (every package, its folder, what it may
import, whether it may load torch or gRPC), and its folder listing names only folders that
exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
RULES_FILE = ROOT / "tests" / "unit" / "test_import_direction.py"


def read_rules(path: Path = RULES_FILE) -> dict:
    """The module-level assignments of the import rules' file (RULES, TORCH_FREE,
    GRPC_FREE, ...), run on their own: a test module is not imported by another
    (tests/unit/test_test_layout.py), and the rules stay written once."""
    tree = ast.parse(path.read_text(), str(path))
    assignments = [n for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign)]
    names: dict = {"Path": Path, "__file__": str(path)}
    exec(compile(ast.Module(assignments, type_ignores=[]), str(path), "exec"), names)
    return names


_RULES = read_rules()
RULES: dict[str, set[str]] = _RULES["RULES"]
LAYERS_MARK = "<!-- layers: checked by tests/unit/test_architecture_doc.py -->"
EVERY_OTHER = "every other package"
COLUMNS = ["package", "folder", "what it holds", "may import", "torch", "gRPC"]


def spans(cell: str) -> list[str]:
    """The code spans of a table cell."""
    return re.findall(r"`([^`]+)`", cell)


def layer_rows(text: str) -> dict[str, dict[str, str]]:
    """The layer table after LAYERS_MARK: package -> {column: cell}."""
    assert LAYERS_MARK in text, f"{DOC.name} has lost its layer table's marker"
    lines = text.split(LAYERS_MARK, 1)[1].strip().splitlines()
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert table and table[0] == COLUMNS, f"the layer table's header is not {COLUMNS}"
    rows: dict[str, dict[str, str]] = {}
    for cells in table[2:]:  # past the header and its |---| line
        assert len(cells) == len(COLUMNS), f"a row of the layer table has {len(cells)} cells"
        row = dict(zip(COLUMNS, cells, strict=True))
        (package,) = spans(row["package"])
        assert package not in rows, f"{package} is in the layer table twice"
        rows[package] = row
    return rows


def allowed_in_doc(cell: str, package: str, packages: set[str]) -> set[str]:
    """The packages a "may import" cell names ("nothing", a list, or every other one)."""
    if cell == "nothing":
        return set()
    if cell == EVERY_OTHER:
        return packages - {package}
    return set(spans(cell))


def folder_of(package: str) -> str:
    """``pdserve.kernels`` -> ``kernels/``; ``pdserve.X`` -> ``services/X/``."""
    name = package.removeprefix("pdserve.")
    return "kernels/" if name == "kernels" else f"services/{name}/"


def layer_problems(text: str, rules: dict | None = None, root: Path = ROOT) -> list[str]:
    """How the layer table differs from the rules (RULES, TORCH_FREE, GRPC_FREE; default:
    those of RULES_FILE) and from the layout."""
    rules = rules or _RULES
    allowed, torch_free, grpc_free = rules["RULES"], rules["TORCH_FREE"], rules["GRPC_FREE"]
    rows = layer_rows(text)
    problems = [f"{p}: not in the layer table" for p in sorted(set(allowed) - set(rows))]
    problems += [f"{p}: no such package in RULES" for p in sorted(set(rows) - set(allowed))]
    for package in sorted(set(rows) & set(allowed)):
        row = rows[package]
        (folder,) = spans(row["folder"]) or [""]
        if folder != folder_of(package) or not (root / folder).is_dir():
            problems.append(f"{package}: folder `{folder}`, but it is `{folder_of(package)}`")
        said = allowed_in_doc(row["may import"], package, set(allowed))
        if said != allowed[package]:
            problems.append(
                f"{package}: the doc allows {sorted(said)}, RULES {sorted(allowed[package])}"
            )
        for column, free in (("torch", torch_free), ("gRPC", grpc_free)):
            expected = "no" if package in free else "yes"
            if row[column] != expected:
                problems.append(f"{package}: {column} says {row[column]!r}, the rules {expected!r}")
    return problems


def listed_folders(text: str) -> list[str]:
    """The paths that start the lines of the "Where things are" listing."""
    section = text.split("## Where things are", 1)[1]
    block = section.split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines()[1:] if line and not line[0].isspace()]


def test_the_layer_table_is_the_import_rules():
    assert layer_problems(DOC.read_text()) == []


def test_the_folder_listing_names_only_what_exists():
    listed = listed_folders(DOC.read_text())
    assert len(listed) >= 10
    assert [p for p in listed if not (ROOT / p).exists()] == []


def test_a_changed_rule_or_a_wrong_row_is_caught():
    text = DOC.read_text()
    rows = layer_rows(text)
    engine_row = next(line for line in text.splitlines() if line.startswith("| `pdserve.engine`"))
    gateway_row = next(line for line in text.splitlines() if line.startswith("| `pdserve.gateway`"))
    kvstore_row = next(line for line in text.splitlines() if line.startswith("| `pdserve.kvstore`"))
    wrong = (
        text.replace(engine_row, engine_row.replace(", `pdserve.kernels` |", " |"))
        .replace(gateway_row, gateway_row.replace("| no | yes |", "| yes | yes |"))
        .replace(kvstore_row + "\n", "")
        .replace(
            "| `pdserve.loadgen` | `services/loadgen/`", "| `pdserve.nosuch` | `services/nosuch/`"
        )
    )
    found = layer_problems(wrong)
    assert any(p.startswith("pdserve.engine: the doc allows") for p in found), found
    assert any(p.startswith("pdserve.gateway: torch says 'yes'") for p in found), found
    assert "pdserve.kvstore: not in the layer table" in found
    assert "pdserve.loadgen: not in the layer table" in found
    assert "pdserve.nosuch: no such package in RULES" in found
    assert len(found) == 5, found
    assert len(rows) == len(RULES)


def test_a_folder_that_is_gone_is_caught():
    text = DOC.read_text().replace("bench/gpu/ ", "bench/nosuch/ ", 1)
    listed = listed_folders(text)
    assert "bench/nosuch/" in listed
    assert [p for p in listed if not (ROOT / p).exists()] == ["bench/nosuch/"]


def test_a_changed_rule_is_caught(tmp_path):
    source = RULES_FILE.read_text()
    loadgen = '"pdserve.loadgen": {"pdserve.core", "pdserve.settings"},'
    assert loadgen in source
    changed = tmp_path / "rules.py"
    changed.write_text(source.replace(loadgen, loadgen.replace("}", ', "pdserve.wire"}')))
    found = layer_problems(DOC.read_text(), read_rules(changed))
    assert found == [
        "pdserve.loadgen: the doc allows ['pdserve.core', 'pdserve.settings'], RULES "
        "['pdserve.core', 'pdserve.settings', 'pdserve.wire']"
    ]
