"""Helpers shared by the benchmarks (each runs as ``python bench/NAME.py``, so this imports as ``common``)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_jsonl"]


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (none if it does not exist), skipping a line still being written."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
