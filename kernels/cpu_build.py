"""Build the C kernels in ``kernels/csrc`` for this machine once, and load them with ctypes.

The shared object is compiled with the system C compiler (the one inductor also needs)
for this CPU (``-march=native``) and linked against the OpenMP runtime that torch itself
loaded, so that the kernels and torch share one thread pool. It is cached under
``$PDSERVE_HOME/kernels`` by a hash of the source, the flags, the compiler and the CPU,
so a second start of a worker pays nothing; a concurrent build by another worker is
harmless (each writes its own temporary file and renames it into place).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
    "-std=gnu11",
)


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded on this machine."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    return cc


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    """``$PDSERVE_HOME/kernels`` (default ``~/.cache/pdserve/kernels``), as the engine's files."""
    home = os.environ.get("PDSERVE_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "pdserve") / "kernels"


def _torch_lib_dir() -> Path:
    return Path(torch.__file__).resolve().parent / "lib"


def bind(lib: ctypes.CDLL, name: str, argtypes: str, restype=None):
    """``lib.name`` with its argument types set from a signature string: p pointer,
    i int, l int64, f float (e.g. "ppli")."""
    codes = {"p": ctypes.c_void_p, "i": ctypes.c_int, "l": ctypes.c_int64, "f": ctypes.c_float}
    fn = getattr(lib, name)
    fn.argtypes = [codes[c] for c in argtypes]
    fn.restype = restype
    return fn


@cache
def load(name: str) -> ctypes.CDLL:
    """The compiled ``csrc/<name>.c`` as a ctypes library (built on first use)."""
    source = CSRC / f"{name}.c"
    cc = _compiler()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cc} does not run: {e}") from None
    torch_lib = _torch_lib_dir()
    link = [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lm"]
    key = hashlib.blake2b(digest_size=12)
    for part in (source.read_bytes(), " ".join(FLAGS + tuple(link)), version, _cpu_id()):
        key.update(part if isinstance(part, bytes) else part.encode())
    target = _cache_dir() / f"{name}-{key.hexdigest()}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cc, *FLAGS, str(source), "-o", tmp, *link]
        try:
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise KernelBuildError(f"compiling {source.name} failed: {e}") from None
            if result.returncode != 0:
                raise KernelBuildError(
                    f"compiling {source.name} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}"
                )
            os.replace(tmp, target)
            logger.info("built %s for this CPU in %s", source.name, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelBuildError(f"loading {target} failed: {e}") from None
