"""Flags to config: :func:`config_from_args` turns the parsed flags of ``pliant run`` and ``pliant agent``
(:mod:`pliant.agent.launch_flags`) into an :class:`pliant.agent.contract.AgentConfig`, and checks what can be checked
before anything starts (a checkpoint directory that cannot be written, a fixed port that is taken, a token that
cannot be one), each with an error that names the flag and the fix. :mod:`pliant.agent.commands` runs the result.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from pliant.agent import snapshots
from pliant.agent.contract import AgentConfig, default_node_id
from pliant.bootstrap import bootstrap_address, parse_pin
from pliant.coordinator.contract import JOIN_TOKEN_RULE, JobSpec, is_join_token, parse_node_range
from pliant.env import parse_every
from pliant.errors import ConfigError
from pliant.net import cannot_listen, is_wildcard, local_address, parse_host_port
from pliant.ports import SeatPorts
from pliant.security.identity import Role
from pliant.security.tlsdir import TlsConfig
from pliant.security.tokens import read_token_file

__all__ = ["advertised_host", "check_free", "check_token", "config_from_args", "embedded_ports", "ignored_notes"]

logger = logging.getLogger(__name__)


def _check_writable(directory: str) -> None:
    """``--checkpoint-dir``: made if missing and written to once, before anything starts, so that a directory the
    workers cannot write fails the command in one line instead of every worker's first save.

    Raises:
        ConfigError: it cannot be made or written; the message names it, why, and the fix.
    """
    path = Path(directory)
    probe = path / f".pliant-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"--checkpoint-dir {directory}: cannot write there ({exc.strerror or exc}); pass a directory this user "
            f"can write, on storage every node reads"
        ) from None


def check_free(host: str, port: int | None, flag: str) -> None:
    """A fixed port (``flag``) that something on this machine already listens on fails before anything starts,
    in one line, instead of after the control plane or the workers started.

    Raises:
        ConfigError: ``host:port`` cannot be listened on; the message names the flag, the port and the fix.
    """
    if not port or not 0 < port < 65536:  # none, any free one, or not a port (the config names it)
        return
    reason = cannot_listen(host, port)
    if reason:
        raise ConfigError(f"{flag}: cannot listen on {host}:{port} ({reason}); stop what uses it or pick another port")


def check_token(token: str) -> None:
    """A join token that cannot be one fails here, not as the coordinator's refusal after the node started.

    Raises:
        ConfigError: the token has not the form of one (its length is said, never the value).
    """
    if token and not is_join_token(token):
        raise ConfigError(
            f"--join-token (or PLIANT_JOIN_TOKEN) of {len(token)} characters is not a join token ({JOIN_TOKEN_RULE}); "
            f"copy the one in the join command the first node printed, or from `pliant job create`"
        )


def _nproc(text: str) -> int:
    if text in ("auto", "gpu"):
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.device_count()
        except ImportError:
            pass
        return 1 if text == "auto" else 0
    if text == "cpu":
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"--nproc-per-node {text!r} must be a positive integer, 'cpu' or 'auto'")
    return value


def ignored_notes(args: argparse.Namespace) -> None:
    for name, value in vars(args).items():
        if name.startswith("ignored_") and value is not None:
            logger.info(
                "--%s=%s accepted for torchrun compatibility; pliant's coordinator makes it unnecessary",
                name[len("ignored_") :].replace("_", "-"),
                value,
            )


def _min_nodes_timeout(args: argparse.Namespace) -> float:
    """--min-nodes-timeout, or torchrun's --rdzv-conf join_timeout=S."""
    conf = getattr(args, "ignored_rdzv_conf", None) or ""
    for item in conf.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout" and value:
            return float(value)
    return args.min_nodes_timeout


def config_from_args(
    args: argparse.Namespace, coordinator: Sequence[str], embedded: bool, tls: TlsConfig | None = None
) -> AgentConfig:
    """Build the agent's config from parsed launch flags and the agent's TLS files (None: plaintext).

    Raises:
        ConfigError: a flag has a bad value; the message names it and the fix.
    """
    low, high = parse_node_range(args.nnodes)
    nproc = _nproc(str(args.nproc_per_node))
    spec = JobSpec(
        job_id=args.job,
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=nproc,
        heartbeat_ttl_s=args.heartbeat_ttl,
        join_grace_s=args.join_grace,
        max_restarts=args.max_restarts,
        min_nodes_timeout_s=_min_nodes_timeout(args),
        node_group=args.node_group,
    )
    script = args.training_script
    if args.module:
        command: tuple[str, ...] = ("-m", script, *args.training_script_args)
    elif args.no_python:
        command = (script, *args.training_script_args)
    else:
        if not Path(script).is_file():
            raise ConfigError(f"training script {script!r} not found (cwd {os.getcwd()}); pass a path to a .py file")
        command = (script, *args.training_script_args)
    if args.checkpoint_dir:
        _check_writable(args.checkpoint_dir)
    host = args.host or advertised_host(args, coordinator, embedded)
    check_free(host, args.store_port, "--store-port")
    check_free(host, args.metrics_port, "--metrics-port")
    node_id = args.node_id
    pin = parse_pin(args.ca_cert_hash) if args.ca_cert_hash and tls is None and not embedded else ""
    if tls is not None:
        identity = tls.load(expect=Role.AGENT).identity
        assert identity is not None
        if node_id and node_id != identity.name:
            raise ConfigError(
                f"--node-id {node_id!r} differs from the node id in {tls.cert} ({identity.name!r}); drop --node-id, "
                f"or use that node's certificate (pliant certs create-agent {node_id})"
            )
        node_id = identity.name
    token = read_token_file(args.join_token_file) if args.join_token_file else args.join_token
    check_token(token)
    if pin and not token:
        raise ConfigError(
            "--ca-cert-hash joins by bootstrap, which needs the job's join token: add --join-token=TOKEN from the "
            "join command the first node printed"
        )
    bootstrap = tuple(b.strip() for b in args.bootstrap.split(",") if b.strip()) if pin else ()
    return AgentConfig(
        coordinator=tuple(coordinator),
        spec=spec,
        command=command,
        nproc_per_node=nproc,
        node_id=node_id or default_node_id(),
        host=host,
        store_port=args.store_port,
        log_dir=args.log_dir,
        checkpoint_dir=args.checkpoint_dir,
        stop_grace_s=args.stop_grace,
        abort_grace_s=args.abort_grace,
        rescale_grace_s=args.rescale_grace,
        finish_grace_s=args.finish_grace,
        hang_timeout_s=args.hang_timeout,
        start_timeout_s=args.start_timeout,
        allow_fresh_start=args.allow_fresh_start,
        rescale=args.rescale,
        snapshot_every=parse_every(args.snapshot_every, "--snapshot-every"),
        snapshot_dir=snapshots.usable(args.snapshot_dir),
        no_python=args.no_python,
        preload=_preload(args),
        heartbeat_retry_s=args.rpc_retry,
        metrics_port=args.metrics_port,
        tls=tls,
        join_token=token,
        ca_cert_hash=pin,
        create_job=bool(getattr(args, "create_job", False)),
        bootstrap=bootstrap or tuple(bootstrap_address(c) for c in coordinator) if pin else (),
    )


def _preload(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``--preload`` / ``--no-preload`` as :attr:`AgentConfig.preload`.

    Raises:
        ConfigError: a name in ``--preload`` is not a module name.
    """
    if args.no_preload:
        return ()
    if args.preload is None:
        return None
    names = tuple(name.strip() for name in args.preload.split(",") if name.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(
                f"--preload {args.preload!r}: {name!r} is not a module name; pass importable modules separated by "
                "commas, e.g. --preload transformers,datasets"
            )
    if not names:
        raise ConfigError(
            f"--preload {args.preload!r} names no module; pass e.g. --preload transformers, or --no-preload"
        )
    return names


def advertised_host(args: argparse.Namespace, coordinator: Sequence[str], embedded: bool) -> str:
    """The address this node's peers reach it on when ``--host`` is not given: with the embedded control plane the
    --listen host (loopback stays loopback: one machine), or for a wildcard the first interface that is up and not
    loopback; joining a coordinator, the local address of the route to it."""
    if embedded:
        listen_host = parse_host_port(args.listen, what="--listen", allow_zero=True)[0]
        return local_address() if is_wildcard(listen_host) else listen_host
    return local_address(toward=coordinator[0])


def embedded_ports(args: argparse.Namespace) -> tuple[str, SeatPorts]:
    """``pliant run``'s ``--listen``: the host the embedded control plane listens on, and its seat's ports
    (:mod:`pliant.ports`), every fixed one checked free here.

    Raises:
        ConfigError: ``--listen`` is not HOST:PORT, or a port of its block is taken (the message names which).
    """
    host, port = parse_host_port(args.listen, what="--listen", allow_zero=True)
    block = SeatPorts.of(port)
    check_free(host, block.api, "--listen")
    if block.api and not args.insecure:  # the bootstrap join's port is the next one, then etcd's two with seats
        seated = parse_node_range(args.nnodes)[1] > 1  # a seat another node can take: etcd serves the network
        for port_, what in block.described()[: 3 if seated else 1]:
            check_free(host, port_, what)
    return host, block
