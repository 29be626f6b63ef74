"""The error every pdserve command stops its start with: a value the user must change."""

from __future__ import annotations


class SettingsError(ValueError):
    """A setting a command cannot start with (a flag, a variable, a model directory); the
    message says which one to change. Commands exit 2 with it."""
