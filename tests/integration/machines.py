"""Machines that share nothing but a network, on this one: each a network namespace with its own address
(bench/netns.py), its own host name (a UTS namespace), a working directory with its own copy of the training script,
its temporary files (``TMPDIR``) and its user's state directory (``XDG_STATE_HOME``) in that directory, and the events
its workers log there. A machine that hides the others' files runs in a mount namespace where the folder of every
machine's directory is an empty tmpfs with only its own bound back in: it sees none of another machine's files, and
everything else (the clone, its virtual environment) as it is. Shared by the tests of the README's two-machines
recipe and of the embedded control plane's seats. Root only.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.netns import Fabric, Node
from tests.integration.harness import ELASTIC, read_jsonl

__all__ = ["Machine", "fabric_fixture", "first_step_at", "ranks_at"]


NETS_PER_MODULE = 4  # the xdist workers a module's fabrics keep apart (scripts/test runs three)


def xdist_worker() -> int:
    """This pytest-xdist worker's index (0 without xdist).

    Raises:
        RuntimeError: more workers than a module has nets for: two tests would share a subnet.
    """
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    if worker >= NETS_PER_MODULE:
        raise RuntimeError(f"xdist worker {worker}: the network-namespace tests have nets for {NETS_PER_MODULE}")
    return worker


def fabric_fixture(prefix: str, net: int) -> Callable[[], Iterator[Fabric]]:
    """A ``fabric`` fixture for one test module's machines: ``10.213.<net>.0/24`` for the first xdist worker,
    ``net - 1`` for the second and so on (each module has four nets of its own, :data:`NETS_PER_MODULE`), named
    ``<prefix><worker>``; closed, every process in it killed, after each test."""

    @pytest.fixture
    def fabric() -> Iterator[Fabric]:
        made = Fabric(prefix=f"{prefix}{xdist_worker()}", net=net - xdist_worker())
        try:
            yield made
        finally:
            made.close()

    return fabric


class Machine:
    """One "machine": a namespace, a host name, a working directory with its copy of the script, its temporary files
    and its state directory."""

    def __init__(self, fabric: Fabric, name: str, root: Path) -> None:
        self.node: Node = fabric.node(name)
        self.hostname = f"host{name}"
        self.root = root
        self.cwd = root / name
        self.state_home = self.cwd / "state"
        self.cwd.mkdir(parents=True)
        shutil.copy(ELASTIC, self.cwd / "train.py")
        self.log = root / f"{name}.log"
        self.procs: list = []

    @property
    def env(self) -> dict[str, str]:
        """What this machine's processes find in their environment besides the caller's: their temporary files and
        their user's state directory, in this machine's directory."""
        return {"TMPDIR": str(self.cwd / "tmp"), "XDG_STATE_HOME": str(self.state_home)}

    def run(self, argv: list[str], hide_others: bool) -> None:
        """Run ``argv`` on this machine, from its working directory (``hide_others``: where no other machine's files
        can be seen)."""
        cwd, root = shlex.quote(str(self.cwd)), shlex.quote(str(self.root))
        setup = f"hostname {self.hostname}"
        # Hiding the others: the machines' folder becomes an empty tmpfs with only this machine's directory in it,
        # bound back in place.
        if hide_others:
            setup += (
                f" && mount --bind {cwd} /mnt && mount -t tmpfs -o size=64m tmpfs {root} && mkdir -p {cwd} && "
                f"mount --bind /mnt {cwd}"
            )
        setup += f" && mkdir -p {shlex.quote(self.env['TMPDIR'])} && cd {cwd}"
        shell = [
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            f'{setup} && exec "$@"',
            "sh",
            "env",
            *(f"{name}={value}" for name, value in self.env.items()),
            *argv,
        ]
        self.procs.append(self.node.spawn(shell, self.log, gloo_ifname=False))

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def events(self) -> list[dict]:
        return read_jsonl(self.cwd / "events.jsonl")

    def stop_at(self, step: int) -> None:
        (self.cwd / "stop.part").write_text(str(step))
        os.replace(self.cwd / "stop.part", self.cwd / "stop")


def ranks_at(machines: list[Machine], world: int, since: float = 0.0) -> set[int]:
    return {e["rank"] for m in machines for e in m.events() if e["world"] == world and e["time"] >= since}


def first_step_at(machines: list[Machine], world: int, since: float, ranks: int) -> float:
    """When every one of ``ranks`` ranks had stepped in a world of ``world`` after ``since`` (wall time)."""
    firsts: dict[int, float] = {}
    for m in machines:
        for e in m.events():
            if e["world"] == world and e["time"] >= since:
                firsts[e["rank"]] = min(firsts.get(e["rank"], e["time"]), e["time"])
    assert len(firsts) == ranks, firsts
    return max(firsts.values())
