"""The committed stubs are exactly what protoc generates from protos/, and
every RPC and field of the wire contract carries a comment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec.protogen import ROOT, generate

PROTOS = sorted((ROOT / "protos").rglob("*.proto"))
FIELD = re.compile(r"^\s+(repeated |optional )?[A-Za-z0-9_.]+ [a-z_0-9]+ = [0-9]+;")
RPC = re.compile(r"^\s+rpc ")


def test_regenerating_stubs_changes_nothing(tmp_path: Path):
    for path in generate(tmp_path):
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is not committed"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed} differs from protoc's output: run python -m specdec.protogen"
        )


@pytest.mark.parametrize("proto", PROTOS, ids=[p.name for p in PROTOS])
def test_every_rpc_and_field_is_documented(proto: Path):
    lines = proto.read_text().splitlines()
    missing = [
        f"{proto.name}:{i + 1}: {line.strip()}"
        for i, line in enumerate(lines)
        if (FIELD.match(line) or RPC.match(line))
        and "//" not in line
        and not lines[i - 1].strip().startswith("//")
    ]
    assert not missing, "undocumented:\n" + "\n".join(missing)
