"""What the worker zygote imports before it forks workers: torch, and what the training script imports at its top level.

A worker forked from the zygote starts with every module the zygote imported, so a script whose framework takes
seconds to import (a Trainer, Lightning, a model zoo) starts as fast as a plain one. The script is read, never run:
its module-level ``import`` and ``from ... import`` statements (also those under a module-level ``if``, ``try`` or
``with``; never those inside a function or class) name what to import, and for ``from X import a, b`` the names too,
since frameworks load lazily (``from transformers import Trainer`` loads the Trainer on the attribute's first read).
Relative imports and ``__future__`` are left out; so are modules that live next to the script (its directory, or the
working directory of a ``-m`` module), which the user may be editing: only installed code is preloaded.

The zygote imports them one at a time (:mod:`pliant.agent.zygote`) and skips, with one log line, a module that fails
to import, starts a thread or initialises CUDA (a process that forks must hold neither). The agent's ``--preload
MODULE,...`` names the modules instead of reading the script; ``--no-preload`` preloads torch only.

The wire format to the zygote is one JSON object (the ``--preload`` argument of ``python -m pliant.agent.zygote``):
``{"imports": [[MODULE, [NAME, ...]], ...], "home": DIR}``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pliant.agent.contract import AgentConfig

__all__ = ["Import", "Preload", "module_source", "plan", "plan_preload", "script_imports"]

_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))
_TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # try/except* from Python 3.11


@dataclass(frozen=True)
class Import:
    """One module to import, and the names to read from it (``from MODULE import NAME, ...``)."""

    module: str
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Preload:
    """What the zygote imports after torch (:data:`pliant.agent.zygote.PRELOAD`).

    Attributes:
        imports: in the script's order.
        home: a worker's ``sys.path[0]``: the script's directory, or the working directory of a ``-m`` module. Its
            modules are the user's own code, never preloaded; the zygote imports with it first on its path, as the
            worker will.
        source: where the list came from, for the agent's log: ``"script"``, ``"--preload"`` or ``"--no-preload"``.
    """

    imports: tuple[Import, ...] = ()
    home: str = ""
    source: str = "script"

    def to_json(self) -> str:
        """The zygote's ``--preload`` argument (the wire format in the module docstring)."""
        return json.dumps({"imports": [[i.module, list(i.names)] for i in self.imports], "home": self.home})

    @classmethod
    def from_json(cls, text: str) -> Preload:
        data = json.loads(text)
        imports = tuple(Import(module, tuple(names)) for module, names in data["imports"])
        return cls(imports=imports, home=data["home"])


def script_imports(source: str, filename: str = "<script>") -> tuple[Import, ...]:
    """The modules a script imports at its top level, in order, without duplicates; the standard library's are left
    out.

    Raises:
        SyntaxError: the script does not parse (the worker reports it when it runs).
    """
    found: dict[str, set[str]] = {}
    for node in _top_level(ast.parse(source, filename).body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module != "__future__":
            names = found.setdefault(node.module, set())
            names.update(alias.name for alias in node.names if alias.name != "*")
    return tuple(
        Import(module, tuple(sorted(names)))
        for module, names in found.items()
        if module.partition(".")[0] not in _STDLIB  # imported in milliseconds by the worker itself
    )


def _top_level(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """The statements that run when the module does: the body and the blocks of its ``if``, ``try`` and ``with``,
    not function or class bodies, nor ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, _TRY):
            yield from _top_level(node.body)
            for handler in node.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(node.orelse)
            yield from _top_level(node.finalbody)
        elif isinstance(node, ast.With):
            yield from _top_level(node.body)
        else:
            yield node


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_source(module: str, search: Sequence[str]) -> Path | None:
    """Where ``python -m MODULE`` would find its source, found without running any of it (a package's ``__init__``
    may import torch, which the agent never does): the top-level package is looked for in the directories
    ``search``, then located (not imported) by the installed finders; None if it is not found."""
    top, *rest = module.split(".")
    roots: list[Path] = []  # the top-level package's directories
    for entry in search:
        base = Path(entry or ".")
        if (base / top).is_dir():
            roots = [base / top]
            break
        if not rest and (base / f"{top}.py").is_file():
            return base / f"{top}.py"
    if not roots:
        try:
            spec = importlib.util.find_spec(top)  # a top-level name is located, never imported
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if not spec.submodule_search_locations:
            return Path(spec.origin) if not rest and spec.origin and spec.origin.endswith(".py") else None
        roots = [Path(place) for place in spec.submodule_search_locations]
    for root in roots:
        base = root.joinpath(*rest)
        for candidate in (base.with_suffix(".py"), base / "__main__.py") if rest else (base / "__main__.py",):
            if candidate.is_file():
                return candidate
    return None


def plan(command: Sequence[str], preload: Sequence[str] | None, cwd: str | None = None) -> Preload:
    """What the zygote preloads for the worker command ``command``.

    Args:
        command: the worker's argv after the interpreter: a script and its arguments, or ``-m`` and a module's.
        preload: the agent's ``--preload`` modules, ``()`` for ``--no-preload``, None to read the script.
        cwd: the workers' working directory (default: this process's).

    A script that cannot be read or parsed preloads nothing: its worker reports the error, as python would.
    """
    cwd = cwd or os.getcwd()
    if command[0] == "-m":
        home = cwd
        path = module_source(command[1], [cwd, *sys.path[1:]])
    else:
        path = Path(cwd, command[0])
        home = str(path.resolve().parent)
    if preload is not None:
        return Preload(
            imports=tuple(Import(name) for name in preload),
            home=home,
            source="--preload" if preload else "--no-preload",
        )
    try:
        imports = script_imports(path.read_text(), str(path)) if path is not None else ()
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        imports = ()
    return Preload(imports=imports, home=home)


def plan_preload(config: AgentConfig) -> Preload:
    """:func:`plan` for an agent's worker command and ``--preload``."""
    return plan(config.command, config.preload)
