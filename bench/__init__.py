"""pdserve's benchmarks, grouped by what they measure, each run as a module from the
repository root (``python -m bench.<group>.<name>``):

- ``bench.kernels``: CPU kernels and the GEMM ceiling, one operation at a time;
- ``bench.engine``: the engine alone, in one process (throughput, step time, speculation,
  sampling, bf16 agreement);
- ``bench.serving``: whole clusters and servers side by side (the comparison with vLLM and
  transformers, KV transfer, faults, tracing, start-up, core layouts);
- ``bench.gpu``: the CUDA checks (Triton kernels, CUDA graphs), with ``gpu/check.sh``.

Results go to bench/out/ (not committed); ``--write-results`` updates bench/RESULTS.md.
"""

from __future__ import annotations

from pathlib import Path

# The repository root: every benchmark's working directory, where .venv and bench/out are.
ROOT = Path(__file__).resolve().parent.parent
