"""``pliant status``: jobs, their state, generation, world size and members, as a table or as JSON.

The rendering functions are pure (the time is passed in); :func:`status_main` does the one ListJobs / GetJob call.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import CoordinatorError, JobInfo, MemberProgress
from pliant.coordinator.convert import job_info_from_pb
from pliant.errors import ConfigError
from pliant.security.tlsdir import TlsConfig
from pliant.statusview import find_view, read_view
from pliant.v1 import coordinator_pb2 as pb

__all__ = ["goodput_line", "job_goodput", "render_json", "render_table", "status_main", "to_dict", "view_main"]


def to_dict(info: JobInfo) -> dict[str, Any]:
    """One job as plain data (the ``--json`` schema)."""
    gen = info.generation
    in_gen = {m.node_id: m for m in gen.members} if gen else {}
    members = []
    for m in info.members:
        p = info.progress.get(m.node_id, MemberProgress())
        g = in_gen.get(m.node_id)
        members.append(
            {
                "node_id": m.node_id,
                "address": m.address,
                "slots": m.slots,
                "joined_at": m.joined_at,
                "in_generation": g is not None,
                "node_rank": g.node_rank if g else None,
                "ranks": [g.rank_offset, g.rank_offset + g.nproc - 1] if g else None,
                "heartbeat_age_s": p.heartbeat_age_s if p.heartbeat_age_s >= 0 else None,
                "step": p.step or None,
                "step_at": p.step_at or None,
                "strikes": p.strikes,
                "goodput_s": dict(p.goodput),
            }
        )
    return {
        "job_id": info.spec.job_id,
        "state": info.status.state.value,
        "outcome": info.status.outcome.value if info.status.outcome is not None else None,
        "reason": info.status.reason,
        "state_since": info.status.since,
        "min_nodes": info.spec.min_nodes,
        "max_nodes": info.spec.max_nodes,
        "nproc_per_node": info.spec.nproc_per_node,
        "generation": gen.number if gen else 0,
        "generation_reason": gen.reason if gen else "",
        "world_size": gen.world_size if gen else 0,
        "restarts_used": gen.restarts_used if gen else 0,
        "refused_world_sizes": [{"world_size": size, "error": error} for size, error in gen.refused] if gen else [],
        "excluded_nodes": (
            [{"node_id": node, "failures": count, "error": error} for node, count, error in gen.excluded] if gen else []
        ),
        "members": members,
        "goodput": job_goodput(info),
    }


def job_goodput(info: JobInfo) -> dict[str, Any] | None:
    """The job's goodput over its live members' time, as their agents last reported it: seconds that trained new
    steps, badput seconds by cause, and the goodput's share; None before any member reported."""
    totals: dict[str, float] = {}
    for progress in info.progress.values():
        for category, seconds in progress.goodput.items():
            totals[category] = totals.get(category, 0.0) + seconds
    total = sum(totals.values())
    if total <= 0:
        return None
    productive = totals.pop("productive", 0.0)
    return {
        "node_seconds": total,
        "productive_s": productive,
        "badput_s": dict(sorted(totals.items())),
        "percent": 100.0 * productive / total,
    }


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds // 60:.0f}m {seconds % 60:.0f}s"
    return f"{seconds // 3600:.0f}h {seconds % 3600 // 60:.0f}m"


def goodput_line(goodput: Mapping[str, Any]) -> str:
    """``goodput 97.3% over 2h 14m of node time; badput: failure 1.9%, rescale 0.6%`` (causes above 0.05 %, largest
    first)."""
    total = goodput["node_seconds"]
    causes = sorted(((s, c) for c, s in goodput["badput_s"].items() if s / total >= 0.0005), reverse=True)
    badput = ", ".join(f"{cause} {100 * s / total:.1f}%" for s, cause in causes) or "none"
    return f"goodput {goodput['percent']:.1f}% over {_duration(total)} of node time; badput: {badput}"


def render_json(jobs: Sequence[JobInfo], unreadable: Mapping[str, str] | None = None) -> str:
    out: dict[str, object] = {"jobs": [to_dict(j) for j in jobs]}
    if unreadable:
        out["unreadable"] = dict(unreadable)
    return json.dumps(out, indent=2, sort_keys=True)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render_table(jobs: Sequence[JobInfo], now: float, unreadable: Mapping[str, str] | None = None) -> str:
    """A readable table per job: a header line, then one row per member; then the jobs that cannot be read."""
    if not jobs and not unreadable:
        return "no jobs"
    out: list[str] = [
        f"job {job}: UNREADABLE, skipped by the coordinator: {why}" for job, why in sorted((unreadable or {}).items())
    ]
    for info in jobs:
        d = to_dict(info)
        outcome = f", {d['outcome']}" if d["outcome"] and d["outcome"] != d["state"] else ""
        state = d["state"] + outcome + (f" ({d['reason']})" if d["reason"] else "")
        out.append(f"job {d['job_id']}: {state}, since {_ago(now - d['state_since'])}")
        out.append(
            f"  generation {d['generation']} ({d['generation_reason'] or 'none yet'}), world size "
            f"{d['world_size']}, nodes {len(d['members'])} (min {d['min_nodes']}, max {d['max_nodes']}), "
            f"restarts used {d['restarts_used']}"
        )
        if d["goodput"] is not None:
            out.append("  " + goodput_line(d["goodput"]) + " (the live nodes')")
        out.extend(
            f"  world size {r['world_size']} refused: it fails on every node with {r['error']}"
            for r in d["refused_world_sizes"]
        )
        excluded = {e["node_id"]: e for e in d["excluded_nodes"]}
        out.extend(
            f"  node {e['node_id']} excluded after {e['failures']} worker failures: {e['error'] or 'no error given'}"
            for e in excluded.values()
        )
        rows = [["NODE", "ADDRESS", "RANKS", "HEARTBEAT", "STEP", "STEP SEEN"]]
        for m in d["members"]:
            ranks = f"{m['ranks'][0]}-{m['ranks'][1]}" if m["ranks"] else "spare"
            if m["node_id"] in excluded and not m["ranks"]:
                ranks = "excluded"
            if m["strikes"] and not m["ranks"]:
                ranks += f" ({m['strikes']} strikes: held back)"
            seen = _ago(now - m["step_at"]) if m["step_at"] else "-"
            rows.append([m["node_id"], m["address"], ranks, _ago(m["heartbeat_age_s"]), str(m["step"] or "-"), seen])
        out.extend("  " + line for line in _table(rows))
    return "\n".join(out)


def status_main(coordinator: str, job: str | None, as_json: bool, tls: TlsConfig | None = None) -> int:
    """Print the status of ``job`` (or every job); 1 when the coordinator cannot answer.

    Raises:
        ConfigError: the TLS files do not load.
    """
    client = CoordinatorClient(coordinator, tls.load() if tls else None, retry_for_s=3.0)
    unreadable: dict[str, str] = {}
    try:
        if job:
            jobs = [client.get_job(job, progress=True)]
        else:
            jobs, unreadable = client.list_jobs_and_errors(progress=True)
    except CoordinatorError as exc:
        print(f"pliant status: error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(render_json(jobs, unreadable) if as_json else render_table(jobs, time.time(), unreadable))
    return 0


def view_main(job: str | None, as_json: bool) -> int:
    """Print ``job`` (or the only job viewed here) as this machine's agent of it sees it (:mod:`pliant.statusview`):
    the newest agent's view that answers.

    Raises:
        ConfigError: no agent of the job runs here, or none of them could read it (the last reason).
    """
    name, sockets = find_view(job)
    failure: ConfigError | None = None
    for path in sockets:
        try:
            info = job_info_from_pb(pb.JobStatus.FromString(read_view(path)))
        except ConfigError as exc:
            failure = exc
            continue
        print(render_json([info]) if as_json else render_table([info], time.time()))
        return 0
    assert failure is not None
    raise ConfigError(f"job {name!r}: {failure}")
