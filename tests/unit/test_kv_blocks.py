"""A received block's header, length and checksum, as the decode worker checks them."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.kv.blocks import (
    LAYOUT_VERSION,
    BlockLayout,
    FetchedBlocks,
    block_checksum,
    block_problem,
    show_key,
    tail_key,
)

LAYOUT = BlockLayout(
    version=LAYOUT_VERSION,
    model_fingerprint=b"\x01" * 16,
    dtype="bfloat16",
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)
KEY = b"\xaa" * 16
DATA = bytes(range(256)) * (LAYOUT.block_bytes // 256)


def test_block_bytes_of_a_smollm2_block():
    assert LAYOUT.block_bytes == 16 * 30 * 2 * 3 * 64 * 2 == 368_640
    assert dataclasses.replace(LAYOUT, dtype="float32").block_bytes == 2 * 368_640
    with pytest.raises(ValueError, match="'int8' are not supported"):
        _ = dataclasses.replace(LAYOUT, dtype="int8").block_bytes


def test_checksum_changes_with_any_byte_the_key_or_the_token_count():
    base = block_checksum(KEY, 16, DATA)
    assert block_checksum(KEY, 16, memoryview(bytearray(DATA))) == base  # views as bytes
    flipped = bytearray(DATA)
    flipped[200_000] ^= 0x01
    assert block_checksum(KEY, 16, bytes(flipped)) != base
    assert block_checksum(b"\xab" + KEY[1:], 16, DATA) != base
    assert block_checksum(KEY, 15, DATA) != base


def test_a_sound_block_has_no_problem():
    checksum = block_checksum(KEY, 16, DATA)
    assert block_problem(LAYOUT, KEY, DATA, 16, LAYOUT, checksum) is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"header": None}, "no layout header"),
        (
            {"header": dataclasses.replace(LAYOUT, dtype="float32")},
            "layout header differs (dtype: ours bfloat16, block's float32)",
        ),
        (
            {"header": dataclasses.replace(LAYOUT, version=1)},
            "layout header differs (version: ours 2, block's 1)",
        ),
        ({"data": DATA[:-2]}, "has 368638 bytes, a block of this layout has 368640"),
        ({"checksum": None}, "no checksum"),
        ({"checksum": 0x12345678}, "its checksum is 0x12345678"),
        ({"data": b"\xff" + DATA[1:]}, "its checksum is"),
        ({"key": b"\xbb" * 16}, "its checksum is"),
    ],
)
def test_each_problem_is_named(change, why):
    block = dict(key=KEY, data=DATA, num_tokens=16, header=LAYOUT)
    block["checksum"] = block_checksum(KEY, 16, DATA)
    block.update(change)
    problem = block_problem(LAYOUT, **block)
    assert problem is not None and why in problem


def test_fetched_blocks_merge_across_replicas():
    a = FetchedBlocks({b"1": b"x"}, {b"2": "bad"}, [b"3"])
    a.merge(FetchedBlocks({b"4": b"y"}, {}, [b"5"]))
    assert a == FetchedBlocks({b"1": b"x", b"4": b"y"}, {b"2": "bad"}, [b"3", b"5"])


def test_keys_show_as_text_or_hex():
    assert show_key(tail_key("req-1")) == "tail/req-1"
    assert show_key(b"\x00\xff") == "00ff"


def test_the_header_names_the_heads_a_block_holds():
    """A whole block is [0, total) of the KV heads, an older peer's header (no head range)
    reads as one; a block of part of the heads (a per-rank export) is refused, naming the
    range."""
    from pdserve.kv.convert import layout_from_proto, layout_to_proto
    from pdserve.v1 import common_pb2

    assert (LAYOUT.kv_head_start, LAYOUT.total_kv_heads) == (0, 3)
    assert layout_from_proto(layout_to_proto(LAYOUT)) == LAYOUT
    older = layout_to_proto(LAYOUT)
    older.ClearField("kv_head_start")
    older.ClearField("total_kv_heads")
    assert common_pb2.BlockLayout.FromString(older.SerializeToString()).total_kv_heads == 0
    assert layout_from_proto(older) == LAYOUT
    part = dataclasses.replace(LAYOUT, num_kv_heads=1, kv_head_start=2, total_kv_heads=3)
    assert part.block_bytes == LAYOUT.block_bytes // 3
    why = block_problem(LAYOUT, KEY, DATA[: part.block_bytes], 16, part, 0)
    assert "kv_head_start: ours 0, block's 2" in why and "num_kv_heads: ours 3, block's 1" in why
