"""One machine of the network, holding the printed join line, used as its worst holder would against a real
``pliant run`` on machines that share nothing but a network (tests/integration/machines.py): it gets an agent
certificate with the token and opens 1,200 calls on the coordinator's API port and 40 on its bootstrap port, never
sending their requests (once, that held every thread of the replica). It holds its 16 and 2; the rest are refused at
once; meanwhile a third machine joins with the same line and the job trains on at world 2. Root only."""

from __future__ import annotations

import re
import shlex
import sys
import time
from pathlib import Path

import pytest

from bench.netns import unavailable
from tests.conftest import wait_for
from tests.integration.machines import Machine, fabric_fixture, ranks_at

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.skipif(bool(WHY), reason=WHY)]

PORT = 29400
API_CALLS, BOOTSTRAP_CALLS = 1200, 40

fabric = fabric_fixture("plh", 19)  # 10.213.19.0/24 down to .16.0/24: no other test's

ATTACKER = Path(__file__).with_name("hostile_caller.py")


def test_one_machine_holding_calls_takes_no_replica_and_a_join_goes_through(fabric, tmp_path: Path) -> None:
    a, b, c = (Machine(fabric, name, tmp_path) for name in "abc")
    argv = [sys.executable, "-m", "pliant", "run", "--listen", f"0.0.0.0:{PORT}", "--nnodes", "1:3"]
    script = ["train.py", "--steps", "100000", "--step-time", "0.05", "--events", "events.jsonl"]
    a.run([*argv, "--nproc-per-node", "1", *script], hide_others=False)
    line = wait_for(lambda: re.search(r"other nodes join with:\n  (.+)\n", a.output()), 90, "the join line").group(1)  # type: ignore[union-attr]
    words = shlex.split(line)
    token = next(w.split("=", 1)[1] for w in words if w.startswith("PLIANT_JOIN_TOKEN="))
    pin = words[words.index("--ca-cert-hash") + 1]
    wait_for(lambda: ranks_at([a], 1) == {0}, 90, "the first machine stepping")

    address, calls = f"{a.node.address}:{PORT}", (str(API_CALLS), str(BOOTSTRAP_CALLS))
    b.run([sys.executable, str(ATTACKER), address, pin, token, "90", *calls], hide_others=False)
    said = wait_for(lambda: re.search(r"bootstrap: (\d+) held, (\d+) refused", b.output()), 60, "the attack")
    api = re.search(r"api: (\d+) held, (\d+) refused", b.output())
    assert api and (int(api.group(1)), int(api.group(2))) == (16, API_CALLS - 16), b.output()[-2000:]
    assert (int(said.group(1)), int(said.group(2))) == (2, BOOTSTRAP_CALLS - 2), b.output()[-2000:]  # type: ignore[union-attr]

    attacked = time.time()
    c.run(["env", *words], hide_others=True)  # another machine joins by bootstrap with the same line, meanwhile
    wait_for(lambda: ranks_at([a, c], 2, attacked) == {0, 1}, 120, "world 2 stepping while the calls are held")
    assert b.procs[-1].poll() is None, "the calls were still held"
    assert "RESOURCE_EXHAUSTED" not in a.output() + c.output(), "nobody else was refused"
