"""Regenerate the committed protobuf/gRPC modules in protos/v1/.

    python tools/gen_protos.py            # rewrite protos/v1/*_pb2*.py(i)
    python tools/gen_protos.py --out DIR  # write them to DIR instead (the staleness test)

The .proto is staged under ckptstage/protos/v1/ in a scratch root so that the
generated modules import each other as ``ckptstage.protos.v1.…`` — the -I root
decides those import paths.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "protos" / "v1"
PROTO_NAME = "ckptstage.proto"
GENERATED = ("ckptstage_pb2.py", "ckptstage_pb2.pyi", "ckptstage_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency, pinned in pyproject.toml

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        staged = root / "ckptstage" / "protos" / "v1"
        staged.mkdir(parents=True)
        shutil.copy(PROTO_DIR / PROTO_NAME, staged / PROTO_NAME)
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            str(staged / PROTO_NAME),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copy(staged / name, out_dir / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR)
    generate(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
