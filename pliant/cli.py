"""The ``pliant`` command: dispatches to the roles. Roles are imported lazily, so ``pliant coordinator`` needs no torch.

Precedence of settings: command-line flag > environment variable (:mod:`pliant.settings`) > default.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from pliant import __version__, settings
from pliant.errors import ConfigError, PliantError
from pliant.flags import Parser, add_tls_flags, tls_from_flags, typed
from pliant.logsetup import setup_logging
from pliant.metrics import add_metrics_port_flag

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pliant", description="Elastic training runtime for PyTorch.")
    parser.add_argument("--version", action="version", version=f"pliant {__version__}")
    parser.add_argument(
        "--log-level",
        default=None,
        help="DEBUG, INFO, WARNING (default: $PLIANT_LOG_LEVEL or WARNING; the job's own lines always show)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    coord = sub.add_parser(
        "coordinator",
        help="run a coordinator replica (gRPC API on etcd)",
        description="Run one coordinator replica. Run several against the same etcd for high availability: any "
        "replica serves every call, one elected leader publishes generations.",
    )
    coord.add_argument(
        "--etcd",
        default=settings.ETCD.flag_default(),
        help="etcd client URLs, comma-separated, e.g. http://10.0.0.1:2379,http://10.0.0.2:2379 (env PLIANT_ETCD)",
    )
    coord.add_argument(
        "--listen",
        default=settings.LISTEN.flag_default(),
        help="HOST:PORT to serve gRPC on (env PLIANT_LISTEN, default 127.0.0.1:29400; 0.0.0.0:29400 for every "
        "interface)",
    )
    add_tls_flags(coord, "coordinator")
    coord.add_argument(
        "--etcd-cacert",
        default=settings.ETCD_CACERT.flag_default(),
        help="CA certificate etcd's server certificate is checked against (https:// endpoints)",
    )
    coord.add_argument(
        "--etcd-cert",
        default=settings.ETCD_CERT.flag_default(),
        help="client certificate for etcd's --client-cert-auth",
    )
    coord.add_argument("--etcd-key", default=settings.ETCD_KEY.flag_default(), help="its private key")
    coord.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve the gRPC health service alone, in plaintext, on this port of --listen's host "
        "(for kubelet probes, which present no client certificate)",
    )
    coord.add_argument(
        "--max-jobs",
        type=typed(int, "an integer"),
        default=settings.MAX_JOBS.flag_default(),
        help="jobs the deployment holds at most; CreateJob past it is RESOURCE_EXHAUSTED (default 1000)",
    )
    coord.add_argument(
        "--finished-job-ttl",
        type=float,
        default=86400.0,
        help="seconds after which a finished job is deleted (like ttlSecondsAfterFinished; 0 keeps "
        "them; default 86400)",
    )
    coord.add_argument(
        "--outage-tolerance",
        type=float,
        default=3600.0,
        help="seconds a whole control-plane outage may last before members' leases expire in etcd; "
        "shorter outages evict nobody who keeps trying (default 3600)",
    )
    coord.add_argument(
        "--max-workers",
        type=int,
        default=1100,
        help="gRPC worker threads of a replica; each agent's WatchGenerations stream holds one, so this bounds the "
        "agents one replica serves (default 1100; see docs/operations.md, Scale)",
    )
    coord.add_argument(
        "--max-watch-streams",
        type=int,
        default=0,
        help="WatchGenerations streams one replica serves at once (default: max workers less 10%%)",
    )
    coord.add_argument(
        "--calls-per-caller",
        type=int,
        default=0,
        help="calls one client certificate may have in flight on a replica, streams included; past it its calls are "
        "refused at once, so that no caller holds the replica's threads (default 16; an agent needs a few)",
    )
    coord.add_argument(
        "--signing-ca-dir",
        default=settings.SIGNING_CA_DIR.flag_default(),
        help="directory with ca.crt and ca.key (pliant certs create-ca; a mounted Secret): this replica signs the "
        "agent certificates of nodes that join by bootstrap (--ca-cert-hash) and renews them, and serves the "
        "bootstrap port (env PLIANT_SIGNING_CA_DIR)",
    )
    coord.add_argument(
        "--bootstrap-listen",
        default=settings.BOOTSTRAP_LISTEN.flag_default(),
        help="HOST:PORT of the bootstrap service with --signing-ca-dir (default: --listen's port + 1)",
    )
    coord.add_argument(
        "--seal-root-file",
        default=settings.SEAL_ROOT_FILE.flag_default(),
        help="file holding the sealing secret that jobs' checkpoint keys derive from (made on first use, mode 0600; "
        "a mounted Secret), shared by every replica; default: a secret kept in etcd, made once (env "
        "PLIANT_SEAL_ROOT_FILE)",
    )
    coord.add_argument(
        "--agent-cert-lifetime",
        type=float,
        default=86400.0,
        help="seconds an agent certificate signed by bootstrap is valid; agents renew it at two thirds (default 86400)",
    )
    coord.add_argument(
        "--prefix",
        default=settings.ETCD_PREFIX.flag_default(),
        help="root of pliant's etcd keys (env PLIANT_ETCD_PREFIX, default /pliant/v1)",
    )
    coord.add_argument(
        "--leader-ttl",
        type=typed(float, "a number of seconds"),
        default=settings.LEADER_TTL.flag_default(),
        help="leader lease TTL in seconds: a dead leader is replaced within about this long (default 5)",
    )
    coord.add_argument(
        "--replica-id",
        default=settings.REPLICA_ID.flag_default(),
        help="this replica's name (env PLIANT_REPLICA_ID, default hostname-pid)",
    )
    add_metrics_port_flag(coord, "on --listen's host")
    coord.set_defaults(func=_cmd_coordinator)

    from pliant.agent.launch_flags import add_launch_flags  # torch-free: flags only

    run = sub.add_parser(
        "run",
        help="run a training script elastically (the torchrun replacement)",
        description="Without --coordinator: start an embedded etcd and coordinator, print the command other nodes "
        "run to join, and run this node's workers. With --coordinator: join that coordinator's job.",
    )
    add_launch_flags(run, "run")
    run.set_defaults(func=_cmd_run)
    agent = sub.add_parser(
        "agent",
        help="run one node's agent against a running coordinator",
        description="Join --coordinator's job --job and run --nproc-per-node workers per generation.",
    )
    add_launch_flags(agent, "agent")
    agent.set_defaults(func=_cmd_agent)

    status = sub.add_parser(
        "status",
        help="show jobs, generations and members",
        description="Show each job's state, generation, world size and members (last heartbeat, step), as a table or "
        "JSON.",
    )
    status.add_argument(
        "--coordinator",
        default=settings.COORDINATOR.flag_default(),
        help="coordinator replica(s) HOST:PORT[,HOST:PORT] (env PLIANT_COORDINATOR); without it, and without "
        "--tls-dir or --insecure, the job this node's agent runs, as the agent sees it (from any node of the job); "
        "else 127.0.0.1:29400",
    )
    status.add_argument("--job", default=None, help="show only this job id")
    status.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    add_tls_flags(status, "admin")
    status.set_defaults(func=_cmd_status)

    from pliant.certs import add_certs_commands

    add_certs_commands(sub)
    from pliant.coordinator.admin import add_job_commands, add_seat_key_command

    add_job_commands(sub)
    add_seat_key_command(sub)
    from pliant.k8s.cli import add_k8s_commands

    add_k8s_commands(sub)

    etcd = sub.add_parser(
        "etcd",
        help="run a single local etcd server (for trying pliant out)",
        description="Run one etcd member on this machine until interrupted; prints its URL.",
    )
    etcd.add_argument("--data-dir", default=None, help="data directory (default: a temporary one, deleted on exit)")
    etcd.add_argument("--host", default="127.0.0.1")
    etcd.add_argument("--port", type=int, default=2379, help="client port (default 2379)")
    etcd.add_argument(
        "--certs-dir",
        default="",
        help="where to write etcd's certificates (made at start by a CA of its own): etcd serves mutual TLS and "
        "accepts only the client certificate in DIR/client, which the coordinator is given (default: a temporary "
        "directory, removed on exit)",
    )
    etcd.add_argument(
        "--insecure",
        action="store_true",
        help="serve plaintext with no client authentication: any local user can read and write every key",
    )
    etcd.set_defaults(func=_cmd_etcd)
    return parser


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from pliant.certs import load_ca
    from pliant.coordinator.server import CoordinatorConfig, CoordinatorServer
    from pliant.coordinator.signer import Signer
    from pliant.security.identity import ca_fingerprint
    from pliant.security.seal import load_or_create_root
    from pliant.security.tlsdir import TlsConfig

    if not args.etcd:
        raise SystemExit(
            "pliant coordinator: --etcd is required (or set PLIANT_ETCD), e.g. --etcd http://127.0.0.1:2379"
        )
    etcd_files = [args.etcd_cacert, args.etcd_cert, args.etcd_key]
    if any(etcd_files) and not all(etcd_files):
        raise ConfigError("etcd TLS needs all three of --etcd-cacert, --etcd-cert and --etcd-key")
    host = args.listen.rpartition(":")[0]
    config = CoordinatorConfig(
        etcd_endpoints=tuple(u.strip() for u in args.etcd.split(",") if u.strip()),
        listen=args.listen,
        prefix=args.prefix,
        leader_ttl_s=args.leader_ttl,
        replica_id=args.replica_id,
        metrics_listen="" if args.metrics_port is None else f"{host}:{args.metrics_port}",
        tls=tls_from_flags(args.tls_dir, args.insecure, "coordinator"),
        insecure=args.insecure,
        etcd_tls=TlsConfig(*etcd_files) if all(etcd_files) else None,
        health_listen="" if args.health_port is None else f"{host}:{args.health_port}",
        max_jobs=args.max_jobs,
        finished_job_ttl_s=args.finished_job_ttl,
        max_workers=args.max_workers,
        max_watch_streams=args.max_watch_streams,
        calls_per_caller=args.calls_per_caller,
        outage_tolerance_s=args.outage_tolerance,
        signer=Signer(load_ca(args.signing_ca_dir), args.agent_cert_lifetime) if args.signing_ca_dir else None,
        bootstrap_listen=args.bootstrap_listen,
        seal_root=load_or_create_root(args.seal_root_file) if args.seal_root_file else None,
    )
    server = CoordinatorServer(config).start()
    print(f"pliant coordinator {config.replica_id} listening on {server.address}", flush=True)
    if server.bootstrap_port:
        fingerprint = ca_fingerprint(config.signer.ca.cert_pem)  # type: ignore[union-attr]
        print(
            f"pliant coordinator {config.replica_id}: bootstrap join on {server.bootstrap_address}; nodes join with "
            f"--coordinator {server.address} --ca-cert-hash {fingerprint} --join-token=TOKEN (pliant job create "
            f"prints the token)",
            flush=True,
        )
    try:
        _wait_for_signal()
    finally:
        server.stop()
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from pliant.agent.commands import run_main

    return run_main(args)


def _cmd_agent(args: argparse.Namespace) -> int:
    from pliant.agent.commands import agent_main

    return agent_main(args)


def _cmd_status(args: argparse.Namespace) -> int:
    from pliant.coordinator.status import status_main

    if args.coordinator is None and not args.tls_dir and not args.insecure:  # this node's view of its job
        from pliant.coordinator.status import view_main

        return view_main(args.job, args.json)
    coordinator = args.coordinator or settings.DEFAULT_COORDINATOR
    return status_main(coordinator, args.job, args.json, tls_from_flags(args.tls_dir, args.insecure, "status"))


def _cmd_etcd(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from pliant.coordinator.etcd_server import EtcdServer, etcd_pki

    if args.insecure and args.certs_dir:
        raise ConfigError("--insecure and --certs-dir contradict each other; drop one")
    certs = None if args.insecure else Path(args.certs_dir or tempfile.mkdtemp(prefix="pliant-etcd-certs-")).resolve()
    server_tls, client = etcd_pki(certs, args.host) if certs else (None, None)
    try:
        with EtcdServer(data_dir=args.data_dir, host=args.host, client_port=args.port, tls=server_tls) as server:
            print(f"etcd serving {server.endpoint} (data {server.data_dir}); Ctrl-C stops it", flush=True)
            if client is not None:
                print(
                    f"etcd: mutual TLS; a coordinator connects with --etcd {server.endpoint} --etcd-cacert "
                    f"{client.ca} --etcd-cert {client.cert} --etcd-key {client.key}",
                    flush=True,
                )
            else:
                print("etcd: PLAINTEXT, no client authentication (--insecure)", flush=True)
            _wait_for_signal()
    finally:
        if certs and not args.certs_dir:
            shutil.rmtree(certs, ignore_errors=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pliant`` console script and ``python -m pliant``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except PliantError as exc:
        print(f"pliant {args.command}: error: {exc}", file=sys.stderr)
        return 2
