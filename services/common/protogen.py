"""Generate the Python gRPC code from protos/ into services/common/proto/ (committed).

python -m services.common.protogen          # regenerate
python -m services.common.protogen --check  # exit 1 if the committed code is stale
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "services" / "common" / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Run grpc_tools.protoc over every proto; returns the generated files."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    for pkg in (out_dir, out_dir / "pdserve", out_dir / "pdserve" / "v1"):
        (pkg / "__init__.py").touch()
    return sorted(p for p in out_dir.rglob("*") if p.is_file())


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
        print("stale generated code (run python -m services.common.protogen):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
