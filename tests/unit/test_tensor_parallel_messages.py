"""Rank 0's messages to the other ranks of a tensor-parallel engine: JSON and raw arrays
(no pickle), the step snapshot's kinds of values round-tripped; anything else refused."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.tensor_parallel import Shard, decode, encode


def test_a_step_message_round_trips():
    snapshot = {
        "counts": (5, 2, 2, 1, 3, 3, 40),
        "prompt_rows": ((1, 2, 37, 3),),
        "input_ids": np.arange(5, dtype=np.int64),
        "block_tables": np.array([[3, 4, 0], [7, 8, 9]], dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.int32),
        "logit_rows": np.array([1, 4], dtype=np.int64),
    }
    kind, (got, bucket) = decode(encode(("step", (snapshot, 2))))
    assert kind == "step" and bucket == 2
    assert got["counts"] == [5, 2, 2, 1, 3, 3, 40]
    assert got["prompt_rows"] == [[1, 2, 37, 3]]
    for name in ("input_ids", "block_tables", "empty", "logit_rows"):
        assert got[name].dtype == snapshot[name].dtype
        np.testing.assert_array_equal(got[name], snapshot[name])
    assert decode(encode(("write", [np.int64(3), 4]))) == ["write", [3, 4]]


def test_what_a_message_cannot_carry_is_refused():
    with pytest.raises(TypeError, match="cannot carry object"):
        encode(("step", object()))


def test_shards_split_evenly_and_the_vocabulary_with_padding():
    assert [Shard(r, 2).range(8) for r in range(2)] == [(0, 4), (4, 8)]
    assert [Shard(r, 4).vocab_range(10) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert Shard(0, 4).vocab_part(10) == 3
    with pytest.raises(ValueError, match="does not divide the model's KV heads"):
        Shard(0, 2).split(3, "KV heads")
