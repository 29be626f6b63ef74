"""Defaults from ``PDSERVE_*`` environment variables, for every command's flags."""

from __future__ import annotations

import os


def env_default(name: str, default: str | None = None) -> str | None:
    """``PDSERVE_<NAME>`` from the environment, else the default."""
    return os.environ.get(f"PDSERVE_{name.upper()}", default)
