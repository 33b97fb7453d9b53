"""The import graph has a bottom and a top: pliant's core (errors, settings, flags, the env contract, networking,
ports, security, wire formats, the console's helpers) imports no role and nothing of the commands or framework
adapters above it, nor torch; the coordinator imports neither torch nor the agent nor the worker; the worker never
imports the coordinator. Checked on every import statement, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
TOP = {"pliant.cli", "pliant.certs", "pliant.run", "pliant.__main__", "pliant.k8s"} | {
    "pliant.data",
    "pliant.integration",
    "pliant.lightning",
    "pliant.transformers",
}
ROLES = ("pliant.agent", "pliant.coordinator", "pliant.worker")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(("pliant", *parts[1:])) if parts[0] != "pliant" else ".".join(parts)
    return name.removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def _under(name: str, packages: set[str] | tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _modules(folder: str) -> list[tuple[str, set[str]]]:
    return [
        (_module(path), _imports(path)) for path in sorted((ROOT / folder).rglob("*.py")) if "/v1/" not in str(path)
    ]


def test_the_core_imports_no_role_no_command_and_no_torch() -> None:
    bad = [
        f"{name} imports {imported}"
        for name, imports in _modules("pliant")
        if not _under(name, TOP)
        for imported in sorted(imports)
        if _under(imported, ROLES) or _under(imported, TOP) or _under(imported, ("torch",))
    ]
    assert not bad, bad


def test_the_coordinator_imports_no_torch_no_agent_and_no_worker() -> None:
    forbidden = ("torch", "pliant.agent", "pliant.worker")
    bad = [
        f"{name} imports {imported}"
        for name, imports in _modules("coordinator")
        for imported in sorted(imports)
        if _under(imported, forbidden) or _under(imported, TOP)
    ]
    assert not bad, bad


def test_the_worker_never_talks_to_the_coordinator() -> None:
    bad = [
        f"{name} imports {imported}"
        for name, imports in _modules("worker")
        for imported in sorted(imports)
        if _under(imported, ("pliant.coordinator", "pliant.agent")) or _under(imported, TOP - {"pliant.integration"})
    ]
    assert not bad, bad


def test_security_imports_only_errors_and_itself() -> None:
    bad = [
        f"{name} imports {imported}"
        for name, imports in _modules("pliant/security")
        for imported in sorted(imports)
        if imported.startswith("pliant") and not _under(imported, ("pliant.errors", "pliant.security", "pliant.v1"))
    ]
    assert not bad, bad
