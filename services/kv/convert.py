"""A block layout to and from its protobuf message (the header of every block on the wire)."""

from __future__ import annotations

from pdserve.kv.blocks import BlockLayout
from pdserve.v1 import common_pb2


def layout_to_proto(layout: BlockLayout) -> common_pb2.BlockLayout:
    """A block layout as its message."""
    return common_pb2.BlockLayout(
        version=layout.version,
        model_fingerprint=layout.model_fingerprint,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        kv_head_start=layout.kv_head_start,
        total_kv_heads=layout.total_kv_heads,
    )


def layout_from_proto(p: common_pb2.BlockLayout) -> BlockLayout:
    """A block layout from its message."""
    return BlockLayout(
        version=p.version,
        model_fingerprint=p.model_fingerprint,
        dtype=p.dtype,
        block_size=p.block_size,
        num_layers=p.num_layers,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        kv_head_start=p.kv_head_start,
        total_kv_heads=p.total_kv_heads,  # 0 (an older peer): all of num_kv_heads
    )
