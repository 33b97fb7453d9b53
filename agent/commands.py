"""``pliant run`` and ``pliant agent``: run what the flags say (:mod:`pliant.agent.launcher` turns them into a
config). ``pliant run`` without ``--coordinator`` starts the embedded control plane's first seat
(:mod:`pliant.coordinator.embedded`: an etcd member and a coordinator replica on this node), prints the line other
nodes join with, and runs this node's agent; with ``--coordinator`` (or as ``pliant agent``) it runs only the agent.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pliant.agent.contract import COORDINATORS
from pliant.agent.launcher import config_from_args, embedded_ports, ignored_notes
from pliant.coordinator.contract import is_join_token, parse_node_range
from pliant.errors import ConfigError
from pliant.flags import tls_from_flags
from pliant.net import is_loopback, is_wildcard, parse_host_port
from pliant.security.seal import load_or_create_root

if TYPE_CHECKING:
    from pliant.agent.runcerts import RunCerts
    from pliant.agent.workers import Zygote
    from pliant.coordinator.embedded import EmbeddedSeat
    from pliant.ports import SeatPorts

__all__ = ["agent_main", "pliant_command", "run_main"]

logger = logging.getLogger(__name__)


def pliant_command() -> list[str]:
    """How this machine runs pliant: ``pliant`` when that is on PATH and is this installation, else this interpreter
    with ``-m pliant`` (an absolute path)."""
    found = shutil.which("pliant")
    if found and Path(found).resolve().parent == Path(sys.executable).resolve().parent:
        return ["pliant"]
    return [sys.executable, "-m", "pliant"]


def _join_command(args: argparse.Namespace, address: str, pin: str, token: str) -> str:
    """The one line other machines run to join: the job's token in the environment (``PLIANT_JOIN_TOKEN=...``: a
    process's environment is its user's alone, where its command line is every local user's), then the command with
    the coordinator's address, the job and, with TLS, the CA's fingerprint (no file of this machine's is named but the
    shared checkpoint directory)."""
    parts = [*pliant_command(), "run", "--coordinator", address]
    parts += ["--ca-cert-hash", pin] if pin else ["--insecure"]
    parts += ["--job", args.job, "--nnodes", args.nnodes, "--nproc-per-node", str(args.nproc_per_node)]
    if args.checkpoint_dir:  # every node must save to and restore from the same directory
        parts += ["--checkpoint-dir", os.path.abspath(args.checkpoint_dir)]
    if args.no_preload:
        parts.append("--no-preload")
    elif args.preload is not None:
        parts += ["--preload", args.preload]
    if args.module:
        parts.append("-m")
    if args.no_python:
        parts.append("--no-python")
    parts += [args.training_script, *args.training_script_args]
    return f"PLIANT_JOIN_TOKEN={shlex.quote(token)} {shlex.join(parts)}"


def agent_main(args: argparse.Namespace) -> int:
    """``pliant agent``: one node's agent joining an existing coordinator."""
    from pliant.agent.preload import plan_preload
    from pliant.agent.workers import Zygote, worker_base_env

    ignored_notes(args)
    coordinator = [c.strip() for c in args.coordinator.split(",") if c.strip()]
    if args.ca_cert_hash and (args.tls_dir or args.insecure):
        other = "--tls-dir" if args.tls_dir else "--insecure"
        raise ConfigError(
            f"--ca-cert-hash joins by bootstrap (the coordinator signs this node's certificate); drop {other}, or drop "
            f"--ca-cert-hash"
        )
    tls = None if args.ca_cert_hash else tls_from_flags(args.tls_dir, args.insecure, "agent")
    config = config_from_args(args, coordinator, embedded=False, tls=tls)
    if hasattr(args, "control_plane_seats") and config.ca_cert_hash:  # `pliant run` joining by the printed line
        if args.seat_key and not is_join_token(args.seat_key):
            raise ConfigError(
                f"--seat-key (or PLIANT_SEAT_KEY) of {len(args.seat_key)} characters is not a seat key; copy the one "
                f"in the seat line the first node printed, or make one with `pliant seat-key`"
            )
        line = _join_command(args, COORDINATORS, config.ca_cert_hash, config.join_token)
        config = dataclasses.replace(config, seat=True, seat_key=args.seat_key, join_line=line)
        _quiet_control_plane()  # a seat this node may take or be handed
    # The zygote's imports are a joining node's critical path (its warm-up): they begin before the agent's own.
    zygote = None if config.no_python else Zygote(worker_base_env(config.nproc_per_node), plan_preload(config))
    try:
        from pliant.agent.agent import Agent

        return Agent(config, zygote=zygote).run()
    finally:
        if zygote is not None:  # the agent closed it, unless it failed to start
            zygote.close()


def _quiet_control_plane() -> None:
    """On a quiet console, a replica on this node says only its errors: what it warns of (a job's failure, a seat's
    change) the agent says in its own lines."""
    if not logging.getLogger().isEnabledFor(logging.INFO):
        logging.getLogger("pliant.coordinator").setLevel(logging.ERROR)


def run_main(args: argparse.Namespace) -> int:
    """``pliant run``: the agent, with an embedded etcd and coordinator unless ``--coordinator`` is given."""
    if args.coordinator:
        if args.standalone:
            raise ConfigError("--standalone starts its own control plane; drop it to join --coordinator")
        return agent_main(args)

    from pliant.agent.preload import plan_preload
    from pliant.agent.runcerts import make_run_certs
    from pliant.agent.workers import Zygote, worker_base_env

    ignored_notes(args)
    if args.tls_dir:
        raise ConfigError(
            "--tls-dir is for joining a running coordinator (with --coordinator); the embedded control "
            "plane makes its own certificates (see --certs-dir)"
        )
    if args.ca_cert_hash:
        raise ConfigError(
            "--ca-cert-hash is for joining a running coordinator (with --coordinator); the embedded control plane "
            "makes its own CA and prints its fingerprint"
        )
    # Validate every flag before creating or starting anything.
    draft = config_from_args(args, ["127.0.0.1:1"], embedded=True)
    listen_host, ports = embedded_ports(args)
    args.host = draft.host
    # The worker zygote's import of torch and the script's modules is the start's critical path: it begins first, and
    # the certificates, etcd and the coordinator are made while it runs. The agent owns and closes it.
    zygote = None if draft.no_python else Zygote(worker_base_env(draft.nproc_per_node), plan_preload(draft))
    certs = None
    try:
        if not args.insecure:  # secure by default: an ephemeral CA for this run
            args.node_id = draft.node_id
            certs = make_run_certs(args.certs_dir, args.node_id, [listen_host, draft.host])
        token = draft.join_token or secrets.token_urlsafe(32)
        args.join_token, args.join_token_file = token, None
        return _run_embedded(args, zygote, certs, token, ports)
    finally:
        if zygote is not None:  # the agent closed it, unless the control plane failed to start
            zygote.close()
        if certs and not args.certs_dir:  # a temporary directory: the CA died with the run
            shutil.rmtree(certs.directory, ignore_errors=True)


def _run_embedded(
    args: argparse.Namespace, zygote: Zygote | None, certs: RunCerts | None, token: str, ports: SeatPorts
) -> int:
    """Start the embedded control plane's first seat (:mod:`pliant.coordinator.embedded`), print the join command,
    and run this node's agent until it ends."""

    from prometheus_client import CollectorRegistry

    from pliant.agent.agent import Agent
    from pliant.coordinator.embedded import EMBEDDED_LEADER_TTL_S, EmbeddedSeat, SeatPlan
    from pliant.coordinator.seat_keeper import SeatKit
    from pliant.coordinator.seats import SEAT_KEY_TTL_S, Seat, wanted_seats

    log_path = str(Path(args.log_dir) / "etcd.log") if args.log_dir else None
    _quiet_control_plane()
    if log_path:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    listen_host = parse_host_port(args.listen, what="--listen", allow_zero=True)[0]
    host = args.host if is_wildcard(listen_host) else listen_host
    seats = wanted_seats(parse_node_range(args.nnodes)[1], args.control_plane_seats) if certs else 1
    # A job another node may join has a seated control plane even with one seat: the seat can then be handed over
    # when this node leaves (pliant.coordinator.seat_handover).
    seated = certs is not None and parse_node_range(args.nnodes)[1] > 1
    # A wildcard --listen serves every interface; the join command names the address this node advertises.
    # etcd serves mutual TLS from a CA of its own (the coordinators are its clients), unless the run is --insecure.
    # With seats, its members on other nodes reach it at this node's address, on the ports after the bootstrap's.
    seal_root = load_or_create_root(args.seal_root_file)
    kit = SeatKit(certs.ca, certs.etcd_ca, seal_root, EMBEDDED_LEADER_TTL_S, seats) if certs and seated else None
    plan = SeatPlan(
        host=host if seated else "127.0.0.1",
        listen=args.listen,
        member_name=args.node_id if seated else "pliant",
        replica_id=args.node_id if seated else "embedded",
        client_port=(ports.etcd_client or None) if seated else None,
        peer_port=(ports.etcd_peer or None) if seated else None,
        etcd_tls=certs.etcd_server if certs else None,
        coordinator_tls=certs.coordinator if certs else None,
        etcd_client_tls=certs.etcd_client if certs else None,
        ca=certs.ca if certs else None,
        seal_root=seal_root,
        seats=kit,
        log_path=log_path,
    )
    registry = CollectorRegistry(auto_describe=True)  # one endpoint: the node's and the coordinator's metrics
    with EmbeddedSeat(plan, registry) as plane:
        etcd, coordinator = plane.etcd, plane.coordinator
        assert coordinator is not None
        address = f"{host}:{coordinator.port}"
        seat_key = secrets.token_urlsafe(32)  # admits the other seats; printed apart from the workers' line
        if coordinator.seats is not None:
            first = Seat(args.node_id, address, etcd.endpoint, etcd.peer_url)
            coordinator.seats.take_first(first, seat_key, SEAT_KEY_TTL_S)
        security = f"mutual TLS, certificates in {certs.directory}" if certs else "PLAINTEXT (--insecure)"
        said_ports = f"ports {coordinator.port}" + (f" and {coordinator.bootstrap_port}" if certs else "")
        if seated:
            said_ports = f"ports {coordinator.port}, {coordinator.bootstrap_port}, {etcd.client_port}, {etcd.peer_port}"
        joinable = parse_node_range(args.nnodes)[1] > 1  # --nnodes 1:1: no node can join, none is told how
        where = f"pliant: coordinator on {address} ({security}; embedded etcd {etcd.endpoint})"
        if not joinable:
            print(where, flush=True)
        else:
            join = _join_command(args, address, certs.fingerprint if certs else "", token)
            print(f"{where}; other nodes join with:\n  {join}", flush=True)
            if coordinator.seats is not None:
                who = (
                    f"{seats - 1} more node(s) may hold a seat of the control plane (an etcd member and a "
                    f"coordinator replica: it then outlives any one node); on those"
                    if seats > 1
                    else "the control plane has one seat, this node's; on the node that is to take it over when "
                    "this node leaves (Ctrl-C hands it over)"
                )
                print(
                    f"pliant: {who}, join instead with (its PLIANT_SEAT_KEY opens the control plane: give it to no "
                    f"other node; valid {SEAT_KEY_TTL_S / 3600:g}h, `pliant seat-key` makes another):\n"
                    f"  PLIANT_SEAT_KEY={seat_key} {join}",
                    flush=True,
                )
            if is_loopback(host):
                print(
                    "pliant: the coordinator listens on loopback: only this machine can join; pass --listen "
                    "0.0.0.0:29400 to let other machines join",
                    flush=True,
                )
            else:
                print(
                    f"pliant: other machines need TCP {said_ports} of {host} open, and this node's store port "
                    f"(--store-port; docs/operations.md lists every port)",
                    flush=True,
                )
        if certs:
            status = f"{shlex.join(pliant_command())} status --coordinator {address}"
            print(f"pliant: `{status} --tls-dir {certs.directory / 'admin'}` shows the job", flush=True)
        config = config_from_args(args, [address], embedded=True, tls=certs.agent if certs else None)
        config = dataclasses.replace(config, admin_tls=certs.admin if certs else None)
        if seated and joinable:
            line = _join_command(args, COORDINATORS, certs.fingerprint if certs else "", token)
            config = dataclasses.replace(config, join_line=line)
        code = Agent(config, zygote=zygote, registry=registry).run()
        if code >= 128 and coordinator.seats is not None:  # left on a signal: the seat goes to another node
            _hand_over(plane, args.node_id)
        return code


def _hand_over(plane: EmbeddedSeat, node: str) -> None:
    """Hand this node's control-plane seat to another node of the job before the run ends
    (:func:`pliant.coordinator.seat_handover.hand_over`); a second signal cuts it short."""
    from pliant.coordinator.seat_handover import hand_over

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    said = lambda line: print(f"pliant: {line}", flush=True)  # noqa: E731
    previous = [signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)]
    try:
        assert plane.coordinator is not None
        hand_over(plane.coordinator, plane.etcd, node, said)
    except KeyboardInterrupt:
        said("left without handing the control-plane seat over: the control plane ends with this node")
    finally:
        for sig, handler in zip((signal.SIGINT, signal.SIGTERM), previous, strict=True):
            signal.signal(sig, handler)
