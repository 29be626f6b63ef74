"""One import name: the wheel installs `pdserve` (and its dist-info) and nothing else, with
the design card's folders mapped onto it (services/ -> pdserve, kernels/ -> pdserve.kernels);
an installed wheel runs from anywhere; and a checkout on ``sys.path`` never hides Hugging
Face's `kernels` package (which transformers imports) behind the kernels/ folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of what the Dockerfile copies."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src)
    for name in ("services", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + [str(src), "-w", str(tmp / "dist")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    (built,) = (tmp / "dist").glob("pdserve-*.whl")
    return built


def test_the_wheel_holds_pdserve_and_its_dist_info_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {
        "pdserve",
        wheel.name.split("-py3")[0] + ".dist-info",
    }
    csrc = ROOT / "kernels" / "csrc"
    sources = {
        f"pdserve/kernels/csrc/{p.name}" for p in csrc.iterdir() if p.suffix in (".c", ".h", ".cpp")
    }
    assert sources and sources <= set(names)
    assert "pdserve/v1/gateway_pb2.pyi" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pdserve = pdserve.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_every_folder_of_the_tree_is_a_listed_package():
    """pyproject's explicit package list is the tree: a new folder cannot be left out."""
    found = {"pdserve"}
    for init in (ROOT / "services").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT / "services")
        if "__pycache__" not in rel.parts:
            found.add(".".join(("pdserve", *rel.parts)))
    found |= {"pdserve.kernels", "pdserve.kernels.csrc"}
    assert set(SETUPTOOLS["packages"]) == found
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_an_installed_wheel_imports_from_anywhere(wheel, tmp_path):
    """The wheel's files alone (no checkout mapping): the embedded API, the kernels' sources
    where cpu_build looks, the generated protos, and Hugging Face's `kernels` untouched."""
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target)]
        + [str(wheel)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    probe = """
import importlib.util, sys
from pdserve import LLM, SamplingParams
import pdserve, pdserve.kernels.cpu_build as cpu_build
from pdserve.v1 import gateway_pb2_grpc
assert LLM.__module__ == "pdserve.engine.llm" and SamplingParams(max_tokens=3).max_tokens == 3
print(pdserve.__file__)
print(cpu_build.CSRC)
spec = importlib.util.find_spec("kernels")
print(spec.origin if spec and spec.origin else "-")
"""
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    package, csrc, hf_kernels = out.stdout.split()
    assert Path(package).is_relative_to(target)
    assert Path(csrc).is_relative_to(target) and (Path(csrc) / "cpu_attention.c").is_file()
    assert not Path(hf_kernels).is_relative_to(target)


def test_a_checkout_on_sys_path_leaves_kernels_to_hugging_face():
    """Run from the repository root (as `python -m bench...` and pytest's workers are):
    `import kernels` is never our folder, and pdserve.kernels still is."""
    probe = """
import importlib.util, pdserve.kernels
spec = importlib.util.find_spec("kernels")
print(spec.origin or "namespace", list(pdserve.kernels.__path__)[0])
"""
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{probe}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    origin, ours = out.stdout.split()
    assert ours == str(ROOT / "kernels")
    assert origin == "namespace" or not Path(origin).is_relative_to(ROOT / "kernels")
