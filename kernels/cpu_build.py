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
import time
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


def _version(cc: str) -> str:
    try:
        return subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cc} does not run: {e}") from None


def _build(source: Path, cc: str, flags: tuple[str, ...], link: list[str], suffix: str) -> Path:
    """``source`` compiled into a cached shared object keyed by everything that shapes it."""
    key = hashlib.blake2b(digest_size=12)
    for part in (source.read_bytes(), " ".join(flags + tuple(link)), _version(cc), _cpu_id()):
        key.update(part if isinstance(part, bytes) else part.encode())
    target = _cache_dir() / f"{source.stem}{suffix}-{key.hexdigest()}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *flags, str(source), "-o", tmp, *link]
    started = time.perf_counter()
    try:
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelBuildError(f"compiling {source.name} failed: {e}") from None
        if result.returncode != 0:
            raise KernelBuildError(
                f"compiling {source.name} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}"
            )
        os.replace(tmp, target)
        logger.info(
            "built %s for this CPU in %.1f s: %s",
            source.name,
            time.perf_counter() - started,
            target,
        )
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _torch_link() -> list[str]:
    torch_lib = _torch_lib_dir()
    return [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lm"]


@cache
def build(name: str) -> Path:
    """The compiled ``csrc/<name>.c``, built on first use."""
    return _build(CSRC / f"{name}.c", _compiler(), FLAGS, _torch_link(), "")


@cache
def load(name: str) -> ctypes.CDLL:
    """The compiled ``csrc/<name>.c`` as a ctypes library (built on first use)."""
    target = build(name)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelBuildError(f"loading {target} failed: {e}") from None


def _cxx_compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    return cxx


@cache
def load_torch_ops(name: str, deps: tuple[str, ...]) -> Path:
    """Build ``csrc/<name>.cpp`` against torch's headers and the C kernels ``deps`` (each
    ``csrc/<dep>.c``), and load it into torch (its ``TORCH_LIBRARY`` registers the ops)."""
    from torch.utils import cpp_extension

    abi = int(torch.compiled_with_cxx11_abi())
    flags = (
        "-O3",
        "-march=native",
        "-fopenmp",
        "-fPIC",
        "-shared",
        "-std=c++17",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
    )
    # Linked by path: the kernels' objects are the ones ctypes loads too.
    link = [str(build(dep)) for dep in deps]
    link += [*_torch_link(), "-lc10", "-ltorch", "-ltorch_cpu"]
    target = _build(CSRC / f"{name}.cpp", _cxx_compiler(), flags, link, "-torch")
    try:
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as e:
        raise KernelBuildError(f"loading {target} failed: {e}") from None
    return target
