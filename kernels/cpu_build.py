"""Build the C kernels in ``kernels/csrc``, one shared object per kernel and instruction set,
and load with ctypes the variant this CPU runs.

A kernel (``KERNELS``) has a variant for each instruction set it is written for
(``ISAS``: portable x86-64, avx2, avx512, amx), its sources compiled with that ISA's target
flags alone and never ``-march=native``: every variant compiles on every x86-64 machine,
whatever its CPU, and the tests run each one the CPU can. ``choose`` picks the widest
variant whose features /proc/cpuinfo lists; ``load(kernel, isa)`` takes a given one (the
tests force each in turn). Their C interface is ``csrc/pdserve_kernels.h``.

The shared objects are compiled with the system C compiler (the one inductor also needs)
and linked against the OpenMP runtime that torch itself loaded, so that the kernels and
torch share one thread pool. Each is cached under ``$PDSERVE_HOME/kernels`` by a hash of
its sources, the headers they include, the flags and the compiler (not the CPU: it decides
only which variant is loaded), so a second start of a worker pays nothing; a concurrent
build by another worker is harmless (each writes its own temporary file and renames it
into place).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"


@dataclass(frozen=True)
class Isa:
    """An instruction set that kernel variants are compiled for."""

    name: str
    flags: tuple[str, ...]  # the compiler's target flags
    cpu_flags: frozenset[str]  # what /proc/cpuinfo lists on a CPU that runs the code


# The x86-64 psABI's levels, as Linux names their features in /proc/cpuinfo.
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_X86 = platform.machine().lower() in ("x86_64", "amd64")

ISAS: dict[str, Isa] = {
    isa.name: isa
    for isa in (
        # Any x86-64 (elsewhere: the compiler's own default target).
        Isa("portable", ("-march=x86-64",) if _X86 else (), frozenset()),
        # AVX2 and FMA (Intel since Haswell, AMD since Zen).
        Isa("avx2", ("-march=x86-64-v3",), _V3),
        # AVX-512 F, BW, CD, DQ, VL (Intel since Skylake-SP, AMD since Zen 4).
        Isa("avx512", ("-march=x86-64-v4",), _V4),
        # AMX tiles with bf16 (Intel since Sapphire Rapids).
        Isa(
            "amx",
            ("-march=x86-64-v4", "-mamx-tile", "-mamx-bf16", "-mavx512bf16"),
            _V4 | {"amx_tile", "amx_bf16", "avx512_bf16"},
        ),
    )
}

# kernel -> {isa: its sources in csrc/}, narrowest first.
KERNELS: dict[str, dict[str, tuple[str, ...]]] = {
    "attention": {
        "portable": ("cpu_attention.c", "cpu_attention_portable.c"),
        "avx2": ("cpu_attention.c", "cpu_attention_avx2.c"),
        "avx512": ("cpu_attention.c", "cpu_attention_avx512.c"),
    },
    "sgemm": {"avx2": ("cpu_sgemm.c",)},
    "gemm": {"amx": ("cpu_gemm.c",)},
    "sample": {
        "avx2": ("cpu_sample.c", "cpu_sample_avx2.c"),
        "avx512": ("cpu_sample.c", "cpu_sample_avx512.c"),
    },
}

FLAGS = (
    "-O3",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    # GCC's default for GNU C, written out: where the ISA has FMA, a * b + c is one fused
    # operation, as the kernels' results (and their tests' exact comparisons) expect.
    "-ffp-contract=fast",
    "-fPIC",
    "-shared",
    "-std=gnu11",
    "-fvisibility=hidden",  # only pdserve_kernels.h's functions are exported
)

_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int, "l": ctypes.c_int64, "f": ctypes.c_float}


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded on this machine."""


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's features as /proc/cpuinfo names them (none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def runs_here(isa: str, flags: frozenset[str] | None = None) -> bool:
    """Whether a CPU with ``flags`` (default: this one) runs code built for ``isa``."""
    return ISAS[isa].cpu_flags <= (cpu_flags() if flags is None else flags)


def variants_here(kernel: str) -> list[str]:
    """The variants of ``kernel`` this CPU runs, narrowest first."""
    return [isa for isa in KERNELS[kernel] if runs_here(isa)]


def choose(kernel: str, flags: frozenset[str] | None = None) -> str | None:
    """The widest variant of ``kernel`` that a CPU with ``flags`` (default: this one) runs,
    or None."""
    runnable = [isa for isa in KERNELS[kernel] if runs_here(isa, flags)]
    return runnable[-1] if runnable else None


def bind(lib: ctypes.CDLL, signatures: dict[str, str]) -> dict[str, Any]:
    """``lib``'s functions by name, typed from signatures of pdserve_kernels.h: a code per
    argument (p pointer, i int, l int64, f float), then ``->`` and the result's code unless
    it is void: "ppli", "->i". tests/unit/test_cpu_kernels.py checks them against the header."""
    fns = {}
    for name, signature in signatures.items():
        args, _, result = signature.partition("->")
        fn = getattr(lib, name)
        fn.argtypes = [_CTYPES[c] for c in args]
        fn.restype = _CTYPES[result] if result else None
        fns[name] = fn
    return fns


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    return cc


def _cxx_compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    return cxx


def _cache_dir() -> Path:
    """``$PDSERVE_HOME/kernels`` (default ``~/.cache/pdserve/kernels``), as the engine's files."""
    home = os.environ.get("PDSERVE_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "pdserve") / "kernels"


def _torch_link() -> list[str]:
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    return [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lm"]


@cache
def _version(cc: str) -> str:
    try:
        return subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cc} does not run: {e}") from None


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _headers(sources: list[Path]) -> list[Path]:
    """The csrc/ headers that ``sources`` include, directly or not, sorted."""
    found: set[Path] = set()
    todo = list(sources)
    while todo:
        for name in _INCLUDE.findall(todo.pop().read_text()):
            header = CSRC / name
            if header not in found:
                found.add(header)
                todo.append(header)
    return sorted(found)


def _build(
    stem: str, sources: list[Path], cc: str, flags: tuple[str, ...], link: list[str]
) -> Path:
    """``sources`` compiled into one cached shared object keyed by everything that shapes it."""
    key = hashlib.blake2b(digest_size=12)
    for part in [*sources, *_headers(sources)]:
        key.update(part.name.encode() + b"\0" + part.read_bytes())
    for part in (" ".join(flags + tuple(link)), _version(cc)):
        key.update(part.encode())
    target = _cache_dir() / f"{stem}-{key.hexdigest()}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *flags, *map(str, sources), "-o", tmp, *link]
    started = time.perf_counter()
    try:
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelBuildError(f"compiling {stem} failed: {e}") from None
        if result.returncode != 0:
            raise KernelBuildError(
                f"compiling {stem} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}"
            )
        os.replace(tmp, target)
        logger.info("built %s in %.1f s: %s", stem, time.perf_counter() - started, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@cache
def build(kernel: str, isa: str, optimize: bool = True) -> Path:
    """The shared object of ``kernel``'s ``isa`` variant, compiled on first use (on any
    machine: the CPU need not run it). ``optimize=False``: at -O1, a check that it builds
    and exports its functions (a variant the CPU cannot run is never run here)."""
    sources = [CSRC / name for name in KERNELS[kernel][isa]]
    flags = FLAGS + ISAS[isa].flags
    name = f"{kernel}-{isa}"
    if not optimize:
        flags, name = tuple("-O1" if f == "-O3" else f for f in flags), f"{name}-O1"
    return _build(name, sources, _compiler(), flags, _torch_link())


def load(kernel: str, isa: str | None = None) -> ctypes.CDLL:
    """``kernel``'s ``isa`` variant (default: ``choose(kernel)``) as a ctypes library, built
    on first use. A variant this CPU does not run is refused (ValueError)."""
    if isa is None:
        isa = choose(kernel)
        if isa is None:
            raise KernelBuildError(f"this CPU runs no variant of the {kernel} kernel")
    elif isa not in KERNELS[kernel]:
        raise ValueError(f"the {kernel} kernel has no {isa} variant: {list(KERNELS[kernel])}")
    elif not runs_here(isa):
        raise ValueError(f"this CPU cannot run the {isa} variant of the {kernel} kernel")
    return _open(kernel, isa)


@cache
def _open(kernel: str, isa: str) -> ctypes.CDLL:
    target = build(kernel, isa)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelBuildError(f"loading {target} failed: {e}") from None
    logger.info(
        "the %s kernel runs its %s variant (this CPU runs %s)", kernel, isa, variants_here(kernel)
    )
    return lib


@cache
def load_torch_ops(name: str, kernels: tuple[str, ...]) -> Path:
    """Build ``csrc/<name>.cpp`` against torch's headers and the C ``kernels``, and load it
    into torch (its ``TORCH_LIBRARY`` registers the ops). Each kernel is linked in the
    variant ``choose`` picks, or where the CPU runs none (sgemm without AVX2, gemm without
    AMX) in its first: the ops never call that kernel then, as no weight is packed for it."""
    from torch.utils import cpp_extension

    abi = int(torch.compiled_with_cxx11_abi())
    flags = (
        "-O3",
        "-fopenmp",
        "-fPIC",
        "-shared",
        "-std=c++17",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
    )
    # Linked by path: the kernels' objects are the ones ctypes loads too.
    link = [str(build(k, choose(k) or next(iter(KERNELS[k])))) for k in kernels]
    link += [*_torch_link(), "-lc10", "-ltorch", "-ltorch_cpu"]
    target = _build(name, [CSRC / f"{name}.cpp"], _cxx_compiler(), flags, link)
    try:
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as e:
        raise KernelBuildError(f"loading {target} failed: {e}") from None
    return target
