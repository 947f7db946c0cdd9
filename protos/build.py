"""Regenerate the Python modules for protos/*.proto (`make protos`)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    # Compile from the repository root so generated modules import each other as `protos.x_pb2`.
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").glob("*.proto"))
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        print(f"error: protoc failed on {protos}", file=sys.stderr)
        return rc
    print("generated:", ", ".join(p.replace(".proto", "_pb2.py") for p in protos))
    return 0


if __name__ == "__main__":
    sys.exit(main())
