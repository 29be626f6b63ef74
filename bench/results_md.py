"""Keep bench/RESULTS.md's sections up to date, each between its own markers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def replace_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) the text between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def machine() -> str:
    """lscpu's model name, core count and ISA class (AMX, AVX-512, AVX2): a section's
    "Machine:" line (figures of two classes are not comparable)."""
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in info.splitlines())
    )
    return f"{fields.get('Model name', '?')}, {os.cpu_count()} cores, {isa_class(fields)}"


def isa_class(lscpu: dict[str, str]) -> str:
    """The machine class as the docs name it, from lscpu's flags."""
    flags = set(lscpu.get("Flags", "").split())
    if "amx_tile" in flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX-512" + (" with avx512_bf16" if "avx512_bf16" in flags else "") + ", no AMX"
    return "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
