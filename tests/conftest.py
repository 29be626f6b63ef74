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

# The files that take longest (each over a minute on 2 cores), longest first. `make test`
# hands whole files to its two xdist workers in collection order (--dist loadfile
# --no-loadscope-reorder): these go first, so the two workers end together rather than
# one running the longest file alone at the end. Order only: a file missing from this
# list runs all the same.
LONGEST_FIRST = (
    "tests/integration/test_exactness_smollm2.py",
    "tests/integration/test_chaos.py",
    "tests/integration/test_openai_smollm2.py",
    "tests/integration/test_control_plane.py",
    "tests/integration/test_up.py",
    "tests/integration/test_migration.py",
    "tests/integration/test_exactness_tiny.py",
    "tests/unit/test_cpu_kernels.py",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {path: k for k, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
