"""Helpers shared by the benchmarks and the tests (each benchmark runs as ``python bench/NAME.py``, so this imports as
``common``; the tests import it as ``bench.common``)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

__all__ = ["longest_pause", "read_jsonl"]


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


def longest_pause(events: list[dict], since: float) -> float:
    """The longest gap between two consecutive steps of rank 0 after ``since`` (wall time) in a training script's
    step events (``rank``, ``time``)."""
    times = sorted(e["time"] for e in events if e["rank"] == 0 and e["time"] >= since)
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)
