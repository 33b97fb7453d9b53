"""The checked-in stubs under pliant/v1 are what protos/ compiles to with the pinned grpcio-tools."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_match_protos(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = module
    spec.loader.exec_module(module)
    generated = module.generate(tmp_path)
    assert generated, "protoc produced nothing"
    for path in generated:
        checked_in = ROOT / "pliant" / "v1" / path.name
        assert checked_in.exists(), f"{checked_in} is missing; run python scripts/gen_protos.py"
        assert path.read_text() == checked_in.read_text(), (
            f"{checked_in} is stale; run python scripts/gen_protos.py and commit the result"
        )
