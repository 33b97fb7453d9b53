"""``pliant job``: an admin's job commands (create, finish, delete, rotate-token) over the coordinator API; and
``pliant seat-key``, a new seat key of an embedded control plane.

``pliant job create`` prints the job's join token once (only its hash is kept); agents join with it
(``--join-token`` / ``PLIANT_JOIN_TOKEN`` / ``--join-token-file``). ``pliant seat-key`` prints a key that lets a node
joining with the job's line take a seat of the control plane (``PLIANT_SEAT_KEY``; only its hash is kept). Every
command needs an admin certificate (``--tls-dir``), or ``--insecure`` against a plaintext coordinator.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from pliant import settings
from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import CoordinatorError, JobSpec, parse_node_range
from pliant.flags import add_tls_flags, tls_from_flags
from pliant.security.tokens import read_token_file

__all__ = ["add_job_commands", "add_seat_key_command", "job_main", "seat_key_main"]


def add_job_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``pliant job ...`` to the top-level subcommands."""
    job = sub.add_parser(
        "job",
        help="create, finish, delete a job or rotate its join token (admin)",
        description="Admin commands on jobs. `create` prints the join token agents need (only once).",
    )
    actions = job.add_subparsers(dest="job_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("job_id", help="the job id")
        p.add_argument(
            "--coordinator",
            default=settings.COORDINATOR.flag_default() or settings.DEFAULT_COORDINATOR,
            help="coordinator replica(s) HOST:PORT[,HOST:PORT] (env PLIANT_COORDINATOR)",
        )
        add_tls_flags(p, "admin")

    create = actions.add_parser("create", help="create a job and print its join token")
    common(create)
    create.add_argument("--nnodes", default="1:1", help="N or MIN:MAX nodes (default 1:1)")
    create.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    create.add_argument("--max-restarts", type=int, default=3, help="worker failures survived (default 3)")
    create.add_argument("--heartbeat-ttl", type=float, default=5.0, help="membership lease TTL, s (default 5)")
    create.add_argument("--join-grace", type=float, default=1.0, help="join batching window, s (default 1)")
    create.add_argument("--node-group", type=int, default=1, help="nodes that train only together (default 1)")
    create.add_argument("--min-nodes-timeout", type=float, default=600.0, help="wait below min nodes, s")
    create.add_argument(
        "--join-token-file",
        default=None,
        help="use the token in this file (e.g. a Kubernetes Secret) instead of a generated one",
    )
    create.add_argument("--write-token", default=None, help="also write the token to this file (mode 0600)")
    finish = actions.add_parser("finish", help="mark a job succeeded or failed")
    common(finish)
    finish.add_argument("--failed", action="store_true", help="mark it failed (default: succeeded)")
    finish.add_argument("--reason", default="finished by an admin", help="why (at most 4 KiB kept)")
    delete = actions.add_parser("delete", help="delete a finished job and all its keys")
    delete.add_argument(
        "--force",
        action="store_true",
        help="delete it even though it has not finished (its agents' workers stop); the way to free space when "
        "etcd refuses every write (its NOSPACE alarm)",
    )
    common(delete)
    rotate = actions.add_parser("rotate-token", help="give a job a new join token (joined nodes are not affected)")
    common(rotate)
    rotate.add_argument("--join-token-file", default=None, help="use the token in this file")
    rotate.add_argument("--write-token", default=None, help="also write the token to this file (mode 0600)")
    job.set_defaults(func=job_main)


def _write_token(path: str | None, token: str) -> None:
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token + "\n")


def _spec(args: argparse.Namespace) -> JobSpec:
    low, high = parse_node_range(args.nnodes)
    return JobSpec(
        args.job_id,
        low,
        high,
        args.nproc_per_node,
        args.heartbeat_ttl,
        args.join_grace,
        args.max_restarts,
        args.min_nodes_timeout,
        args.node_group,
    )


def job_main(args: argparse.Namespace) -> int:
    """Run one ``pliant job`` action; 1 when the coordinator refuses it."""
    tls = tls_from_flags(args.tls_dir, args.insecure, f"job {args.job_command}")
    given = read_token_file(args.join_token_file) if getattr(args, "join_token_file", None) else ""
    spec = _spec(args) if args.job_command == "create" else None
    client = CoordinatorClient(args.coordinator, tls.load() if tls else None, retry_for_s=5.0)
    try:
        if spec is not None:
            _info, created, token = client.create_job(spec, given)
            if not created:
                print(f"job {spec.job_id} already exists with this spec; its join token is unchanged", flush=True)
                return 0
            _write_token(args.write_token, token)
            print(
                f"job {spec.job_id} created; agents join with its token in their environment (never on a command "
                f"line, which every local user can read), or in a file (--join-token-file):\n"
                f"  PLIANT_JOIN_TOKEN={shlex.quote(token)}",
                flush=True,
            )
        elif args.job_command == "finish":
            info = client.finish_job(args.job_id, not args.failed, args.reason)
            print(f"job {args.job_id} {info.status.state.value}", flush=True)
        elif args.job_command == "delete":
            client.delete_job(args.job_id, force=args.force)
            print(f"job {args.job_id} deleted", flush=True)
        else:
            token = client.rotate_join_token(args.job_id, given)
            _write_token(args.write_token, token)
            print(
                f"job {args.job_id}: new join token (the old one no longer joins):\n"
                f"  PLIANT_JOIN_TOKEN={shlex.quote(token)}",
                flush=True,
            )
    except CoordinatorError as exc:
        print(f"pliant job {args.job_command}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def add_seat_key_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``pliant seat-key`` to the top-level subcommands."""
    seat = sub.add_parser(
        "seat-key",
        help="make a seat key of an embedded control plane (admin)",
        description="Print a new seat key: a node that joins with the job's join line and PLIANT_SEAT_KEY set to it "
        "takes a seat of the control plane (an etcd member and a coordinator replica) while one is free. The key "
        "opens the control plane (its CA keys): give it only to the nodes chosen to hold seats.",
    )
    seat.add_argument(
        "--coordinator",
        default=settings.COORDINATOR.flag_default() or settings.DEFAULT_COORDINATOR,
        help="coordinator replica(s) HOST:PORT[,HOST:PORT] (env PLIANT_COORDINATOR)",
    )
    seat.add_argument(
        "--ttl", type=float, default=0.0, help="seconds it admits new seats (default 7200, at most a week)"
    )
    add_tls_flags(seat, "admin")
    seat.set_defaults(func=seat_key_main)


def seat_key_main(args: argparse.Namespace) -> int:
    """``pliant seat-key``: 1 when the coordinator refuses."""
    tls = tls_from_flags(args.tls_dir, args.insecure, "seat-key")
    client = CoordinatorClient(args.coordinator, tls.load() if tls else None, retry_for_s=5.0)
    try:
        key, expires_at = client.create_seat_key(args.ttl)
    except CoordinatorError as exc:
        print(f"pliant seat-key: error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    until = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(expires_at))
    print(
        f"a node takes a control-plane seat when it runs the job's join line with this in its environment (valid "
        f"until {until}; give it to no other node):\n  PLIANT_SEAT_KEY={key}",
        flush=True,
    )
    return 0
