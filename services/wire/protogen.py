"""Generate the Python gRPC code from protos/ into services/v1/ (committed), the package
``pdserve.v1``: the proto package's own name, so the ``import pdserve.v1.x_pb2`` lines protoc
writes resolve as they are.

python -m pdserve.wire.protogen          # regenerate
python -m pdserve.wire.protogen --check  # exit 1 if the committed code is stale
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "services" / "v1"
INIT = (
    '"""Generated from protos/pdserve/v1 by ``python -m pdserve.wire.protogen``; do not edit."""\n'
)


def generate(out_dir: Path) -> list[Path]:
    """Run grpc_tools.protoc over every proto into ``out_dir`` (the package pdserve.v1);
    returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in (Path(tmp) / "pdserve" / "v1").iterdir():
            shutil.copyfile(f, out_dir / f.name)
    (out_dir / "__init__.py").write_text(INIT)
    return sorted(p for p in out_dir.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = ap.parse_args(argv)
    if not args.check:
        generate(OUT_DIR)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp): p for p in generate(Path(tmp))}
        committed = {
            p.relative_to(OUT_DIR): p
            for p in OUT_DIR.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
        stale = sorted(
            str(k)
            for k in fresh.keys() | committed.keys()
            if k not in fresh
            or k not in committed
            or not filecmp.cmp(fresh[k], committed[k], shallow=False)
        )
    if stale:
        print("stale generated code (run python -m pdserve.wire.protogen):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
