"""Regenerate the checked-in Python stubs under pliant/v1 from protos/pliant/v1/*.proto.

Usage: ``python scripts/gen_protos.py [OUT_DIR]`` (default: the repository root). The test suite runs it into a
temporary directory and diffs the result against the checked-in stubs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto under protos/ into ``out_dir`` and return the generated files."""
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    args = ["protoc", f"--proto_path={ROOT / 'protos'}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {', '.join(map(str, protos))}")
    return sorted(out_dir.joinpath("pliant", "v1").glob("*_pb2*.py"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(target):
        print(path)
