"""Byte sizes from flags: "2GiB", "512MB", "1000000"."""

from __future__ import annotations

import re

from pdserve.core.errors import SettingsError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_size(value: str | int) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1000000"`` or an int -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot read size {value!r}: use a number of bytes or e.g. 512MiB, 2GiB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def size_setting(flag: str, value: str | int) -> int:
    """A size flag's value in bytes ("2GiB"); SettingsError naming the flag when unreadable."""
    try:
        return parse_size(value)
    except ValueError as error:
        raise SettingsError(f"{flag}: {error}") from None
