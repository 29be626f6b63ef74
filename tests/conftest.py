"""The test session's environment, set before anything imports torch or triton, and the
plugin that holds every shared fixture (tests/helpers/fixtures.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite's processes (two xdist workers, the servers the tests start) share the
# machine's cores, each with its own OpenMP pool: threads that spin between parallel
# regions take the cores another process's pool waits for. Two eager engines side by
# side on 2 cores ran 155 s each with libgomp's default wait, 20 s with a passive one.
# libgomp reads this when torch loads it, so it is set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Triton kernels run in its interpreter on machines without a GPU; this must be set
# before anything imports triton.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


pytest_plugins = ["tests.helpers.fixtures"]
