"""Configuration is declared once: every environment variable pliant reads is a :mod:`pliant.settings` entry (or the
worker env contract's, :mod:`pliant.env`), and no other module reads the environment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pliant import settings

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ("agent", "coordinator", "pliant", "worker")
OWNERS = {"pliant/settings.py", "pliant/env.py"}
# Variables of other libraries, set for them where they read them: not pliant's settings.
SETS_FOR_OTHERS = {
    "worker/inplace/nccl.py": "NCCL's error handling, read by torch when a group forms",
    "agent/workers.py": "the agent's environment, passed on to its workers (its credentials taken out)",
}


def _environment_uses(path: Path) -> list[int]:
    """The lines of ``path`` that touch ``os.environ`` or call ``os.getenv``."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("environ", "getenv", "putenv")
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    ]


def test_only_the_settings_and_the_env_contract_read_the_environment() -> None:
    offenders = []
    for folder in PACKAGE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in OWNERS or name in SETS_FOR_OTHERS or "/v1/" in name:
                continue
            offenders += [f"{name}:{line}" for line in _environment_uses(path)]
    assert not offenders, f"read the environment through pliant.settings (or pliant.env): {offenders}"


def test_every_pliant_variable_named_in_the_package_is_declared() -> None:
    declared = {setting.name for setting in settings.SETTINGS}
    contract = set(__import__("pliant.env", fromlist=["WorkerEnv"]).WorkerEnv().to_env()) | {
        "TORCHELASTIC_ERROR_FILE",
        "PLIANT_METRICS_DIR",
        "PLIANT_SNAPSHOT_DIR",
        "PLIANT_WARRANT",
        "PLIANT_PUBLISHED_AT",
    }
    named = {
        node.value
        for folder in PACKAGE
        for path in (ROOT / folder).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_variable(node.value)
    }
    assert named - declared - contract == set()


def _is_variable(text: str) -> bool:
    return text.startswith("PLIANT_") and text.isupper() and text.replace("_", "").isalnum()


def test_a_setting_reads_its_variable_or_its_default() -> None:
    assert settings.JOB.read({}) == "default"
    assert settings.JOB.read({"PLIANT_JOB": ""}) == "default", "empty is unset"
    assert settings.JOB.read({"PLIANT_JOB": "train"}) == "train"
    assert len({s.name for s in settings.SETTINGS}) == len(settings.SETTINGS)
    assert all(s.meaning and s.kind for s in settings.SETTINGS)
