"""The committed generated gRPC code matches protos/ (regenerated with grpc_tools.protoc)."""

from __future__ import annotations

import re
import tomllib

from pdserve.wire import protogen


def test_generated_code_is_fresh():
    assert protogen.main(["--check"]) == 0, "run: python -m pdserve.wire.protogen"


def test_generated_modules_import():
    from pdserve.v1 import decode_pb2, kvstore_pb2_grpc

    assert decode_pb2.DecodeRequest(request_id="x").request_id == "x"
    assert hasattr(kvstore_pb2_grpc, "KVStoreStub")


def _floor(requirement: str) -> tuple[int, ...]:
    (version,) = re.findall(r">=\s*([0-9.]+)", requirement)
    return tuple(int(x) for x in version.split("."))


def test_pyproject_asks_for_the_runtimes_the_generated_code_needs():
    """The generated modules raise at import on a grpcio or protobuf older than the
    generator's: an install that pip calls satisfied must not fail there."""
    deps = tomllib.loads((protogen.ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=;\s]", d, maxsplit=1)[0]: d for d in deps["dependencies"]}
    grpc_code = (protogen.OUT_DIR / "common_pb2_grpc.py").read_text()
    (grpc_needed,) = re.findall(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_code)
    pb_code = (protogen.OUT_DIR / "common_pb2.py").read_text()
    (pb_needed,) = re.findall(r"# Protobuf Python Version: ([0-9.]+)", pb_code)
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert _floor(deps[name]) >= tuple(int(x) for x in grpc_needed.split(".")), name
    assert _floor(deps["protobuf"]) >= tuple(int(x) for x in pb_needed.split("."))
    major = pb_needed.split(".")[0]
    assert f"<{int(major) + 1}" in deps["protobuf"], "a protobuf of another major refuses it"
