"""The C kernels' build (kernels/cpu_build.py): every ISA variant of every kernel compiles on
this machine, whatever its CPU; the widest variant a CPU runs is the one chosen; and the
ctypes signatures agree with the C interface, csrc/pdserve_kernels.h. Each kernel's own
tests (test_attention_cpu.py, ...) check every variant this CPU runs against the reference."""

from __future__ import annotations

import ctypes
import re

import pytest

from pdserve.kernels import attention_cpu, cpu_build, gemm_cpu, sample_cpu, sgemm_cpu

WRAPPERS = {"attention": attention_cpu, "sgemm": sgemm_cpu, "gemm": gemm_cpu, "sample": sample_cpu}
EVERY_VARIANT = [(kernel, isa) for kernel, isas in cpu_build.KERNELS.items() for isa in isas]


def header_signatures(text: str) -> dict[str, str]:
    """The ``PD_API`` prototypes of a C header as cpu_build.bind's signature strings."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    codes = {"int64_t": "l", "int": "i", "float": "f"}

    def code(decl: str) -> str:
        if "*" in decl:
            return "p"
        *type_words, _name = decl.split()
        return codes[type_words[-1]]

    found = {}
    for result, name, params in re.findall(r"PD_API\s+(\w+)\s+(pd_\w+)\s*\(([^)]*)\)\s*;", text):
        params = " ".join(params.split())
        args = "" if params in ("", "void") else "".join(code(p) for p in params.split(","))
        found[name] = args + ("" if result == "void" else "->" + codes[result])
    return found


def test_the_header_reads_as_signatures():
    text = """
    /* PD_API void pd_not_this(int x); */
    PD_API int pd_a(void);
    PD_API void pd_b(const float* x, int64_t x_s, int rows,
                     float scale, uint16_t* out);
    """
    assert header_signatures(text) == {"pd_a": "->i", "pd_b": "plifp"}


def test_every_function_of_the_header_is_bound_with_its_signature():
    """A C signature changed without its ctypes binding (or the reverse) fails here, not as
    a corrupted call."""
    header = header_signatures((cpu_build.CSRC / "pdserve_kernels.h").read_text())
    bound = {name: sig for module in WRAPPERS.values() for name, sig in module.SIGNATURES.items()}
    assert bound == header


@pytest.mark.parametrize("kernel, isa", EVERY_VARIANT)
def test_every_variant_builds_here_and_exports_its_kernel(kernel, isa):
    """Each variant compiles with its own target flags on any x86-64 machine (a CPU without
    AVX-512 or AMX still builds those), and exports its kernel's functions. Loading does not
    run its code, so this holds for a variant the CPU cannot run too; such a variant is
    built at -O1 here (at -O3 the AVX-512 attention alone took 31-42 s on 2 AVX2 cores)."""
    lib = ctypes.CDLL(str(cpu_build.build(kernel, isa, optimize=cpu_build.runs_here(isa))))
    fns = cpu_build.bind(lib, WRAPPERS[kernel].SIGNATURES)
    assert set(fns) == set(WRAPPERS[kernel].SIGNATURES)


AVX2 = cpu_build.ISAS["avx2"].cpu_flags
AVX512 = cpu_build.ISAS["avx512"].cpu_flags
AMX = cpu_build.ISAS["amx"].cpu_flags


@pytest.mark.parametrize(
    "flags, attention, sample, gemm",
    [
        (frozenset(), "portable", None, None),
        (AVX2 - {"fma"}, "portable", None, None),
        (AVX2, "avx2", "avx2", None),
        (AVX512 - {"avx512vl"}, "avx2", "avx2", None),
        (AVX512, "avx512", "avx512", None),
        (AMX, "avx512", "avx512", "amx"),
    ],
)
def test_the_widest_variant_the_cpu_runs_is_chosen(flags, attention, sample, gemm):
    assert cpu_build.choose("attention", flags) == attention
    assert cpu_build.choose("sample", flags) == sample
    assert cpu_build.choose("gemm", flags) == gemm
    assert cpu_build.choose("sgemm", flags) == ("avx2" if flags >= AVX2 else None)


def test_a_variant_the_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset())
    with pytest.raises(ValueError, match="cannot run the avx2 variant"):
        cpu_build.load("attention", "avx2")
    with pytest.raises(ValueError, match="no amx variant"):
        cpu_build.load("attention", "amx")
    with pytest.raises(cpu_build.KernelBuildError, match="no variant of the sample kernel"):
        cpu_build.load("sample")
