"""Idle-leader benchmark: the CPU a coordinator replica spends leading N jobs that wait for nodes and change nothing.

A real etcd and one coordinator replica (a subprocess, mutual TLS); an admin creates N jobs (min 1 node, none joins);
after they settle, the replica's CPU (user + system) is read over a window and printed as a share of one core, with
how many jobs the leader read (its plan counter) in that window.

Usage: ``.venv/bin/python bench/idle_leader.py [--jobs 1000] [--seconds 30]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from control_plane import Security, _scrape, replica_cpu_s, start_replica

from pliant.coordinator.contract import JobSpec
from pliant.coordinator.etcd_server import EtcdServer
from pliant.security.issuance import LocalCA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pliant-idle-"))
    security = Security(LocalCA(work / "pki"))
    with EtcdServer() as etcd:
        proc, address, metrics = start_replica(etcd.endpoint, "/bench", "r0", work, 2.0, security)
        try:
            with security.client([address]) as admin:
                for i in range(args.jobs):
                    admin.create_job(JobSpec(f"job-{i}", 1, 2, min_nodes_timeout_s=7 * 24 * 3600))
            time.sleep(10.0)  # the creations' passes settle
            plans = "pliant_coordinator_plan_duration_seconds_count"
            before, cpu = _scrape([metrics]), replica_cpu_s([proc.pid])
            time.sleep(args.seconds)
            after, used = _scrape([metrics]), replica_cpu_s([proc.pid]) - cpu
            read = after.get(plans, 0.0) - before.get(plans, 0.0)
            print(
                f"idle leader of {args.jobs} waiting jobs: {100 * used / args.seconds:.1f}% of a core, "
                f"{read / args.seconds:.1f} jobs planned per second, over {args.seconds:g}s"
            )
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


if __name__ == "__main__":
    main()
