"""The package pip builds from pyproject.toml holds every module of the source tree: a non-editable install (a
wheel, a container image) imports what an editable checkout does."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_source_tree_is_declared() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(setuptools["packages"])
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join((name, *init.parent.relative_to(ROOT / folder).parts)))
    missing = sorted(found - declared)
    assert not missing, f"pyproject.toml's [tool.setuptools] packages lacks {missing}: a wheel would not hold them"
    empty = sorted(declared - found)
    assert not empty, f"pyproject.toml's [tool.setuptools] packages names folders with no __init__.py: {empty}"
