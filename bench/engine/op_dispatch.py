"""Per-call cost of a Python-implemented torch op: ``torch.library.custom_op`` against an
op defined with ``torch.library.Library`` (what ``services/engine/model/ops.py`` uses).

Both ops take the arguments of ``pdserve::cpu_linear`` and return a preallocated tensor,
so what is timed is the dispatch alone; a compiled decode step makes about 150 such calls.

    .venv/bin/python -m bench.engine.op_dispatch
"""

from __future__ import annotations

import statistics
import time

import torch

RESULT = torch.empty(16, 576)


@torch.library.custom_op("pdserve_bench_a::op", mutates_args=())
def _custom_op(x: torch.Tensor, handle: torch.Tensor, n: int) -> torch.Tensor:
    return RESULT


_lib = torch.library.Library("pdserve_bench_b", "DEF")
_lib.define("op(Tensor x, Tensor handle, int n) -> Tensor")
_lib.impl("op", lambda x, handle, n: RESULT, "CompositeExplicitAutograd")


def per_call_us(op, calls: int = 20000, repeats: int = 7) -> float:
    x, handle = torch.empty(16, 576), torch.zeros(1, dtype=torch.int64)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            op(x, handle, 5)
        times.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(times)


def main() -> int:
    with torch.inference_mode():
        for _ in range(2):  # alternate, so that drift hits both
            a = per_call_us(torch.ops.pdserve_bench_a.op)
            b = per_call_us(torch.ops.pdserve_bench_b.op)
            print(f"custom_op {a:.2f} us/call, Library {b:.2f} us/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
