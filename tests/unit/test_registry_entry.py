"""A registry entry (WorkerInfo) through its JSON: what a worker writes reads back the same,
and older or newer writers' entries still parse."""

from __future__ import annotations

import json
import time

from pdserve.controlplane.registry import WorkerInfo
from pdserve.controlplane.signing import Verifier, registry_key

TOKEN = "internal-token-0123456789abcdef"


def _worker(**fields) -> WorkerInfo:
    return WorkerInfo("decode-1", "decode", "10.0.0.1:50052", model="tiny", **fields)


def test_an_entry_reads_back_with_its_tensor_parallel_size():
    entry = _worker(tensor_parallel_size=2, block_size=16, updated_at=time.time())
    text = entry.to_json(registry_key(TOKEN))
    data = json.loads(text)
    assert data["tensor_parallel_size"] == 2
    assert Verifier.for_tokens(TOKEN).why_refused(data) is None  # signed with the field
    assert WorkerInfo.from_json(text) == entry


def test_an_entry_written_before_tensor_parallelism_reads_as_one_rank():
    old = json.loads(_worker().to_json())
    del old["tensor_parallel_size"]
    assert WorkerInfo.from_dict(old).tensor_parallel_size == 1


def test_a_newer_writers_unknown_fields_are_set_aside():
    newer = {**json.loads(_worker(tensor_parallel_size=4).to_json()), "pipeline_size": 2}
    assert WorkerInfo.from_dict(newer) == _worker(tensor_parallel_size=4)
