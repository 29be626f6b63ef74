"""The policy checkers an SRE's pipeline runs, over what pdserve ships: checkov over the
rendered chart (the default values and each helm/pdserve/ci values file) and hadolint over
the Dockerfile. Both must report nothing beyond the findings accepted, with their reasons,
in .checkov.yaml and .hadolint.yaml. They live in a virtualenv of their own, which
`make test` builds and names by POLICY_TOOLS_BIN; a run of pytest without it skips this."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.helm_chart import CI_VALUES, ROOT, template

BIN = os.environ.get("POLICY_TOOLS_BIN")
pytestmark = pytest.mark.skipif(not BIN, reason="POLICY_TOOLS_BIN unset: run `make test`")


def _tool(name: str) -> str:
    path = Path(BIN) / name
    assert path.exists(), f"{path} is missing: `make test` installs the policy tools"
    return str(path)


def test_checkov_finds_nothing_in_the_rendered_chart(tmp_path):
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    for values in [None, *CI_VALUES]:
        name = values.name.removesuffix("-values.yaml") if values else "default"
        (rendered / f"{name}.yaml").write_text(template([values] if values else []).stdout)
    done = subprocess.run(
        [_tool("checkov"), "--config-file", str(ROOT / ".checkov.yaml"), "-d", str(rendered)]
        + ["-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(done.stdout)
    summary = report["summary"]
    failed = [
        f"{f['check_id']} {f['check_name']}: {f['resource']} ({Path(f['file_path']).name})"
        for f in report["results"]["failed_checks"]
    ]
    assert failed == [] and done.returncode == 0, "\n".join(failed) or done.stderr
    assert summary["parsing_errors"] == 0 and summary["resource_count"] >= 6 * len(CI_VALUES)
    assert summary["passed"] > 100  # it did check


def test_hadolint_finds_nothing_in_the_dockerfile():
    done = subprocess.run(
        [_tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), "--no-color"]
        + [str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
