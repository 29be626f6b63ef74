"""The chart's tensor-parallel size (helm/pdserve, `tensorParallelSize` in `engine` and in a
pool's `engine`): rendered into that pool's worker args alone, its ranks splitting the pod's
CPU request as their threads, and refused below 1 by the schema."""

from __future__ import annotations

import pytest

from tests.helpers.helm_chart import of_kind, render, template


def _worker_args(set_values: dict) -> dict[str, list[str]]:
    """Each worker pool's args, by pool."""
    deployments = of_kind(render(set_values=set_values), "Deployment")
    return {
        pool: deployments[f"t-pdserve-{pool}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        for pool in ("prefill", "decode")
        if f"t-pdserve-{pool}" in deployments
    }


def test_a_pools_size_reaches_its_own_workers_and_splits_their_cpu():
    args = _worker_args(
        {"decode.engine.tensorParallelSize": 2, "decode.resources.requests.cpu": "5"}
    )
    assert "--tensor-parallel-size=2" in args["decode"]
    assert "--num-threads=2" in args["decode"]  # 5 cores over 2 ranks
    assert "--tensor-parallel-size=1" in args["prefill"]
    assert not any(a.startswith("--num-threads=") for a in args["prefill"])  # from the env


def test_the_clusters_size_reaches_every_pool_and_numthreads_wins():
    args = _worker_args({"engine.tensorParallelSize": 2, "engine.numThreads": 3})
    for pool in ("prefill", "decode"):
        assert "--tensor-parallel-size=2" in args[pool] and "--num-threads=3" in args[pool]


def test_colocated_decode_workers_take_it_too():
    args = _worker_args({"disaggregation": False, "decode.engine.tensorParallelSize": 4})
    assert list(args) == ["decode"]
    assert "--tensor-parallel-size=4" in args["decode"]
    assert "--num-threads=1" in args["decode"]  # 2 cores over 4 ranks: at least 1


@pytest.mark.parametrize("key", ["engine.tensorParallelSize", "prefill.engine.tensorParallelSize"])
def test_the_schema_refuses_no_ranks(key):
    done = template(set_values={key: 0}, check=False)
    assert done.returncode != 0, f"{key}=0 rendered"
    assert "schema" in done.stderr and "tensorParallelSize" in done.stderr, done.stderr
