"""The committed generated gRPC code matches protos/ (regenerated with grpc_tools.protoc)."""

from __future__ import annotations

from pdserve.wire import protogen


def test_generated_code_is_fresh():
    assert protogen.main(["--check"]) == 0, "run: python -m pdserve.wire.protogen"


def test_generated_modules_import():
    from pdserve.v1 import decode_pb2, kvstore_pb2_grpc

    assert decode_pb2.DecodeRequest(request_id="x").request_id == "x"
    assert hasattr(kvstore_pb2_grpc, "KVStoreStub")
