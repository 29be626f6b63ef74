"""docs/configuration.md is what ``python -m pdserve.config_docs`` writes from the settings
classes and the parsers, so that the flags, variables and defaults it lists are the code's."""

from __future__ import annotations

from pathlib import Path

from pdserve import config_docs
from pdserve.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_md_is_generated_from_the_settings():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_docs.render(), (
        f"docs/configuration.md is not what the settings say: run `{config_docs.REGENERATE}`"
    )


def test_every_command_has_a_section():
    page = config_docs.render()
    for name in COMMANDS:
        if name == "bench":
            for sub in ("serve", "sweep", "plot"):
                assert f"## `pdserve bench {sub}`" in page
        else:
            assert f"## `pdserve {name}`" in page


def test_a_secret_default_is_hidden():
    rows = [line for line in config_docs.render().splitlines() if "`--internal-token`" in line]
    assert rows and all("(hidden)" in row for row in rows)
