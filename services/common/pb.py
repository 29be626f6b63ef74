"""The generated protobuf and gRPC modules of protos/pdserve/v1, importable as one place.

protoc's ``*_pb2_grpc.py`` import their messages as ``pdserve.v1.x_pb2`` (the proto
package path), so the generated tree's root goes on ``sys.path`` here, once, on purpose.
"""

from __future__ import annotations

import sys
from pathlib import Path

_GENERATED = str(Path(__file__).resolve().parent / "proto")
if _GENERATED not in sys.path:
    sys.path.insert(0, _GENERATED)

from pdserve.v1 import (  # noqa: E402
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

__all__ = [
    "common_pb2",
    "decode_pb2",
    "decode_pb2_grpc",
    "gateway_pb2",
    "gateway_pb2_grpc",
    "kvstore_pb2",
    "kvstore_pb2_grpc",
    "prefill_pb2",
    "prefill_pb2_grpc",
]
