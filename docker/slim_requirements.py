"""Print the requirements of the slim image (the gateway and the kvstore), one per line:
pyproject.toml's dependencies less those [tool.pdserve] engine-only names.

    python docker/slim_requirements.py > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirement_name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement, normalized (PEP 503)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def slim_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """The project's dependencies that the gateway and the kvstore need."""
    config = tomllib.loads(pyproject.read_text())
    engine_only = {requirement_name(n) for n in config["tool"]["pdserve"]["engine-only"]}
    deps = config["project"]["dependencies"]
    return [d for d in deps if requirement_name(d) not in engine_only]


if __name__ == "__main__":
    sys.stdout.write("".join(f"{r}\n" for r in slim_requirements()))
