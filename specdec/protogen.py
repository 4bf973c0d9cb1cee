"""Regenerate the committed gRPC stubs in ``specdec/v1`` from ``protos/``.

The stubs are committed so that running the services needs no grpcio-tools;
``tests/test_protos.py`` checks that regenerating them changes nothing.
Usage: ``python -m specdec.protogen [--out DIR]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("specdec/v1/*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    init = out / "specdec" / "v1" / "__init__.py"
    init.write_text('"""Generated gRPC stubs of the specdec.v1 wire contract (do not edit)."""\n')
    return sorted((out / "specdec" / "v1").glob("*"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT)
    args = ap.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out), file=sys.stderr)


if __name__ == "__main__":
    main()
