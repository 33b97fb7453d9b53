"""``pliant run`` and ``pliant agent``: torchrun-compatible flags, the embedded control plane, and the agent.

``pliant run`` without ``--coordinator`` starts an embedded etcd (temporary data dir, free ports) and coordinator,
prints the command other nodes run to join, and runs this node's agent. With ``--coordinator`` (or as
``pliant agent``) it runs only the agent. torchrun's flags are accepted under their torchrun names (dashes or
underscores) where they make sense, and refused with the pliant way where they do not.
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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pliant.agent import snapshots
from pliant.agent.contract import COORDINATORS, AgentConfig, default_node_id, state_home
from pliant.bootstrap import bootstrap_address, parse_pin
from pliant.coordinator.contract import JOIN_TOKEN_RULE, JobSpec, is_join_token, parse_node_range
from pliant.env import AUTO, parse_every
from pliant.errors import ConfigError
from pliant.metrics import add_metrics_port_flag
from pliant.net import cannot_listen, is_loopback, is_wildcard, local_address, parse_host_port
from pliant.seal import load_or_create_root
from pliant.tls import Role, TlsConfig, add_tls_flags, read_token_file, tls_from_flags

if TYPE_CHECKING:
    from pliant.agent.runcerts import RunCerts
    from pliant.agent.workers import Zygote
    from pliant.coordinator.etcd_server import EtcdServer
    from pliant.coordinator.server import CoordinatorServer

__all__ = ["add_launch_flags", "agent_main", "config_from_args", "run_main"]

logger = logging.getLogger(__name__)


class _Refuse(argparse.Action):
    """A torchrun flag pliant does not take: fail with the pliant way to do it."""

    def __init__(self, option_strings: Sequence[str], dest: str, fix: str = "", **kwargs: object) -> None:
        self.fix = fix
        super().__init__(option_strings, dest, nargs="?", **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: object, values: object, option: str | None = None):
        parser.error(f"{option} is not supported by pliant: {self.fix}")


def _names(*names: str) -> list[str]:
    """Each flag under its dashed and its underscored spelling (torchrun accepts both)."""
    out: list[str] = []
    for name in names:
        out += [name, "--" + name[2:].replace("-", "_")]
    return list(dict.fromkeys(out))


def add_launch_flags(parser: argparse.ArgumentParser, mode: str) -> None:
    """Add the launch flags of ``pliant run`` (``mode="run"``) or ``pliant agent`` (``mode="agent"``)."""
    env = os.environ.get
    parser.add_argument(*_names("--nnodes"), default="1:1", help="N or MIN:MAX nodes (default 1:1)")
    parser.add_argument(*_names("--nproc-per-node"), default="1", help="workers per node: N, 'cpu' or 'auto'")
    parser.add_argument(
        *_names("--max-restarts"),
        type=int,
        default=3,
        help="worker failures the job survives; scaling events never count (default 3)",
    )
    parser.add_argument(
        "--job",
        *_names("--rdzv-id"),
        dest="job",
        default=env("PLIANT_JOB", "default"),
        help="job id (torchrun: --rdzv-id; env PLIANT_JOB; default 'default')",
    )
    parser.add_argument(
        "--coordinator",
        *_names("--rdzv-endpoint"),
        dest="coordinator",
        default=env("PLIANT_COORDINATOR"),
        required=mode == "agent",
        help="HOST:PORT[,HOST:PORT...] of the coordinator (torchrun: --rdzv-endpoint)",
    )
    if mode == "run":
        parser.add_argument(
            "--listen",
            default="127.0.0.1:0",
            help="HOST:PORT of the embedded coordinator (default 127.0.0.1:0: a free loopback port; "
            "use 0.0.0.0:29400 to let other machines join)",
        )
        parser.add_argument(
            "--standalone",
            action="store_true",
            help="one node with the embedded control plane (the default without --coordinator)",
        )
        parser.add_argument(
            "--control-plane-seats",
            type=int,
            choices=(1, 3, 5),
            default=0,
            help="nodes of the job that host the embedded control plane (an etcd member and a coordinator replica "
            "each), so that it outlives the loss of any one of them (1 of 3, 2 of 5); default 3 when --nnodes lets "
            "the job have 3 nodes, else 1",
        )
        parser.add_argument(
            "--seat-key",
            default=env("PLIANT_SEAT_KEY", ""),
            help="the embedded control plane's seat key (env PLIANT_SEAT_KEY, the way the first node prints it): "
            "a node that joins with it takes a seat of the control plane while one is free (an etcd member and a "
            "coordinator replica, with the control plane's CA keys); without it a node is a worker node only "
            "(kubeadm join's --certificate-key)",
        )
    add_tls_flags(parser, "agent")
    parser.add_argument(
        "--ca-cert-hash",
        default=env("PLIANT_CA_CERT_HASH", ""),
        help="sha256:HEX of the coordinator CA's public key, as the first node's join command prints it (env "
        "PLIANT_CA_CERT_HASH): without --tls-dir the agent joins by bootstrap, pinning that CA before it sends the "
        "join token, making its own key and having its certificate signed (kubeadm join's "
        "--discovery-token-ca-cert-hash)",
    )
    parser.add_argument(
        "--bootstrap",
        default="",
        help="HOST:PORT[,...] of the coordinators' bootstrap service (default: each --coordinator address with its "
        "port + 1)",
    )
    parser.add_argument(
        "--join-token",
        default=env("PLIANT_JOIN_TOKEN", ""),
        help="the job's join token (env PLIANT_JOIN_TOKEN): printed by `pliant run`'s join command or `pliant job "
        "create`; without one the agent creates the job (needs admin rights)",
    )
    parser.add_argument("--join-token-file", default=None, help="read the join token from this file")
    if mode == "run":
        parser.add_argument(
            "--certs-dir",
            default="",
            help="where the embedded control plane writes the certificates of this run (its own CA, made at start; "
            "default: a new temporary directory)",
        )
        parser.add_argument(
            "--seal-root-file",
            default=env("PLIANT_SEAL_ROOT_FILE", "") or default_seal_root_file(),
            help="the embedded control plane's sealing secret, made on first use (mode 0600): the job's checkpoint "
            "key derives from it, so a run started again on this machine resumes from the checkpoints it sealed; "
            "copy it to start the first node elsewhere (env PLIANT_SEAL_ROOT_FILE; default "
            "$XDG_STATE_HOME/pliant/seal-root, else ~/.local/state/pliant/seal-root)",
        )
    parser.add_argument(
        "--checkpoint-dir",
        default=env("PLIANT_CHECKPOINT_DIR", ""),
        help="exported to workers as PLIANT_CHECKPOINT_DIR",
    )
    parser.add_argument(*_names("--log-dir"), default="", help="per-worker log files: DIR/JOB/gen-G/rank-R.log")
    parser.add_argument("--node-id", default="", help="this node's id (default HOSTNAME-PID)")
    parser.add_argument(
        "--host",
        *_names("--local-addr"),
        dest="host",
        default="",
        help="IP address other nodes reach this node on (default: the local address of the route to the "
        "coordinator; with the embedded control plane the --listen address, or for 0.0.0.0 the first interface "
        "that is up and not loopback)",
    )
    parser.add_argument(
        "--store-port",
        type=int,
        default=0,
        help="port of this node's agent store; the stores of each generation (node rank 0) use the next ports "
        "(default: free ports)",
    )
    add_metrics_port_flag(
        parser, "the agent's and its workers', with the embedded control plane also the coordinator's, on --host"
    )
    parser.add_argument("--heartbeat-ttl", type=float, default=5.0, help="membership lease TTL, s (default 5)")
    parser.add_argument("--join-grace", type=float, default=1.0, help="join batching window, s (default 1)")
    parser.add_argument(
        "--min-nodes-timeout",
        type=float,
        default=600.0,
        help="how long the job may wait below min nodes before it fails, s (default 600)",
    )
    parser.add_argument("--stop-grace", type=float, default=5.0, help="SIGTERM -> SIGKILL grace for workers, s")
    parser.add_argument(
        "--rescale-grace",
        type=float,
        default=30.0,
        help="how long workers may take to checkpoint and exit on a rescale, s (default 30)",
    )
    parser.add_argument(
        "--rescale",
        default="in-place",
        help="how a running group takes a new generation: in-place (pliant.worker scripts keep their processes and "
        "state; newcomers get the state from peers, no disk) or restart (checkpoint, exit, start again; always the "
        "path of scripts without pliant.worker). Default in-place",
    )
    parser.add_argument(
        "--snapshot-every",
        default=AUTO,
        help="with --rescale in-place, a sharded engine (zero, fsdp) copies each rank's shard to a buddy rank on "
        "another node every this many steps; after a rank's death the survivors roll back to that copy, so at most "
        "this many steps run again. Default auto: from the copies' measured cost, the fewest steps (4 to 64) that "
        "keep them within 1.5%% of the training's time",
    )
    parser.add_argument(
        "--snapshot-dir",
        default=None,
        help="a folder in node-local memory (tmpfs) where the workers keep those copies, so that a dead worker's "
        "outlive it and its replacement offers them to the survivors; '' keeps them in the workers' memory only. "
        "Default /dev/shm (a directory of its own, removed when the agent exits)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        help="a worker that completes no step for this long is hung: its stacks are dumped and the group restarted, "
        "s (default: 10 x the median step time, at least 60)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="a worker that reaches no first step (imports, compile, restore), or spends longer in one checkpoint "
        "save, is hung, s (default 600; 0: never)",
    )
    parser.add_argument(
        "--allow-fresh-start",
        action="store_true",
        help="when checkpoints exist in --checkpoint-dir but none can be loaded, train from step 0 instead of failing "
        "(pliant.worker scripts)",
    )
    parser.add_argument(
        "--finish-grace",
        type=float,
        default=10.0,
        help="once the job succeeded, how long this node's workers may take to exit, s (default 10)",
    )
    parser.add_argument(
        "--rpc-retry",
        type=float,
        default=10.0,
        help="how long calls to an unreachable coordinator are retried, s (default 10)",
    )
    preload = parser.add_mutually_exclusive_group()
    preload.add_argument(
        "--preload",
        default=None,
        metavar="MODULE,...",
        help="the modules each node's worker zygote imports after torch, so that every worker starts with them loaded "
        "(default: what the training script imports at its top level, read from the script; installed modules only)",
    )
    preload.add_argument(
        "--no-preload",
        action="store_true",
        help="preload torch only: each worker imports the script's other modules itself",
    )
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)")
    parser.add_argument(*_names("--no-python"), action="store_true", help="run SCRIPT as a command, not with Python")
    # torchrun flags that mean nothing here but are harmless: accepted, noted in the log.
    for flag in (
        "--rdzv-backend",
        "--rdzv-conf",
        "--monitor-interval",
        "--start-method",
        "--role",
        "--tee",
        "--redirects",
        "--event-log-handler",
        "--signals-to-handle",
        "--run-path",
    ):
        parser.add_argument(
            *_names(flag), dest=f"ignored_{flag[2:].replace('-', '_')}", default=None, help=argparse.SUPPRESS
        )
    refused = {
        "--node-rank": "pliant assigns node ranks in join order; remove --node-rank",
        "--master-addr": "pliant hosts the store itself; join a job with --coordinator HOST:PORT",
        "--master-port": "pliant hosts the store itself; join a job with --coordinator HOST:PORT",
        "--local-ranks-filter": "every rank's output is shown with a [rank]: prefix; use --log-dir for files",
        "--logs-specs": "use --log-dir",
        "--numa-binding": "bind workers inside your script or container instead",
        "--virtual-local-rank": "LOCAL_RANK is always the real local rank",
    }
    for flag, fix in refused.items():
        parser.add_argument(*_names(flag), action=_Refuse, fix=fix, help=argparse.SUPPRESS)
    parser.add_argument("training_script", help="the training script (or module with -m, command with --no-python)")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)


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


def _check_free(host: str, port: int | None, flag: str) -> None:
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


def _check_token(token: str) -> None:
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


def _ignored_notes(args: argparse.Namespace) -> None:
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
    _check_free(host, args.store_port, "--store-port")
    _check_free(host, args.metrics_port, "--metrics-port")
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
    _check_token(token)
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


def default_seal_root_file() -> str:
    """Where ``pliant run`` keeps its sealing secret by default: the user's state directory (XDG)."""
    return str(state_home() / "seal-root")


def advertised_host(args: argparse.Namespace, coordinator: Sequence[str], embedded: bool) -> str:
    """The address this node's peers reach it on when ``--host`` is not given: with the embedded control plane the
    --listen host (loopback stays loopback: one machine), or for a wildcard the first interface that is up and not
    loopback; joining a coordinator, the local address of the route to it."""
    if embedded:
        listen_host = parse_host_port(args.listen, what="--listen", allow_zero=True)[0]
        return local_address() if is_wildcard(listen_host) else listen_host
    return local_address(toward=coordinator[0])


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
    from pliant.agent.agent import Agent

    _ignored_notes(args)
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
    return Agent(config).run()


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

    _ignored_notes(args)
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
    listen_host, listen_port = parse_host_port(args.listen, what="--listen", allow_zero=True)
    _check_free(listen_host, listen_port, "--listen")
    if listen_port and not args.insecure:  # the bootstrap join's port is the next one, then etcd's two with seats
        _check_free(listen_host, listen_port + 1, "--listen's port + 1 (the bootstrap join's port)")
        if parse_node_range(args.nnodes)[1] > 1:  # a seat another node can take: etcd serves the network
            _check_free(listen_host, listen_port + 2, "--listen's port + 2 (etcd's client port)")
            _check_free(listen_host, listen_port + 3, "--listen's port + 3 (etcd's peer port)")
    args.host = draft.host
    certs = None
    if not args.insecure:  # secure by default: an ephemeral CA for this run
        args.node_id = draft.node_id
        certs = make_run_certs(args.certs_dir, args.node_id, [listen_host, draft.host])
    token = draft.join_token or secrets.token_urlsafe(32)
    args.join_token, args.join_token_file = token, None
    # The worker zygote imports torch while etcd and the coordinator start; the agent owns and closes it.
    zygote = None if draft.no_python else Zygote(worker_base_env(draft.nproc_per_node), plan_preload(draft))
    try:
        return _run_embedded(args, zygote, certs, token)
    finally:
        if certs and not args.certs_dir:  # a temporary directory: the CA died with the run
            shutil.rmtree(certs.directory, ignore_errors=True)


def _run_embedded(args: argparse.Namespace, zygote: Zygote | None, certs: RunCerts | None, token: str) -> int:
    """Start the embedded etcd and coordinator, print the join command, and run this node's agent until it ends."""

    from prometheus_client import CollectorRegistry

    from pliant.agent.agent import Agent
    from pliant.coordinator.etcd_server import EtcdServer
    from pliant.coordinator.seat_keeper import SeatKit
    from pliant.coordinator.seats import SEAT_KEY_TTL_S, Seat, wanted_seats
    from pliant.coordinator.server import CoordinatorConfig, CoordinatorServer
    from pliant.coordinator.signer import Signer

    log_path = str(Path(args.log_dir) / "etcd.log") if args.log_dir else None
    _quiet_control_plane()
    if log_path:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    listen_host, listen_port = parse_host_port(args.listen, what="--listen", allow_zero=True)
    host = args.host if is_wildcard(listen_host) else listen_host
    seats = wanted_seats(parse_node_range(args.nnodes)[1], args.control_plane_seats) if certs else 1
    # A job another node may join has a seated control plane even with one seat: the seat can then be handed over
    # when this node leaves (pliant.coordinator.seat_handover).
    seated = certs is not None and parse_node_range(args.nnodes)[1] > 1
    # A wildcard --listen serves every interface; the join command names the address this node advertises.
    # etcd serves mutual TLS from a CA of its own (the coordinators are its clients), unless the run is --insecure.
    # With seats, its members on other nodes reach it at this node's address, on the ports after the bootstrap's.
    etcd = EtcdServer(
        host=host if seated else "127.0.0.1",
        client_port=listen_port + 2 if seated and listen_port else None,
        peer_port=listen_port + 3 if seated and listen_port else None,
        log_path=log_path,
        die_with_parent=True,
        tls=certs.etcd_server if certs else None,
        name=args.node_id if seated else "pliant",
    )
    with etcd:
        kit = None
        if certs and seated:
            kit = SeatKit(certs.ca, certs.etcd_ca, load_or_create_root(args.seal_root_file), 2.0, seats)
        coord_config = CoordinatorConfig(
            etcd_endpoints=(etcd.endpoint,),
            listen=args.listen,
            leader_ttl_s=2.0,
            replica_id=args.node_id if seated else "embedded",
            tls=certs.coordinator if certs else None,
            etcd_tls=certs.etcd_client if certs else None,
            insecure=certs is None,
            signer=Signer(certs.ca) if certs else None,
            seal_root=load_or_create_root(args.seal_root_file),
            seats=kit,
        )
        registry = CollectorRegistry(auto_describe=True)  # one endpoint: the node's and the coordinator's metrics
        with CoordinatorServer(coord_config, registry) as coordinator:
            address = f"{host}:{coordinator.port}"
            seat_key = secrets.token_urlsafe(32)  # admits the other seats; printed apart from the workers' line
            if coordinator.seats is not None:
                first = Seat(args.node_id, address, etcd.endpoint, etcd.peer_url)
                coordinator.seats.take_first(first, seat_key, SEAT_KEY_TTL_S)
            security = f"mutual TLS, certificates in {certs.directory}" if certs else "PLAINTEXT (--insecure)"
            ports = f"ports {coordinator.port}" + (f" and {coordinator.bootstrap_port}" if certs else "")
            if seated:
                ports = f"ports {coordinator.port}, {coordinator.bootstrap_port}, {etcd.client_port}, {etcd.peer_port}"
            joinable = parse_node_range(args.nnodes)[1] > 1  # --nnodes 1:1: no node can join, none is told how
            plane = f"pliant: coordinator on {address} ({security}; embedded etcd {etcd.endpoint})"
            if not joinable:
                print(plane, flush=True)
            else:
                join = _join_command(args, address, certs.fingerprint if certs else "", token)
                print(f"{plane}; other nodes join with:\n  {join}", flush=True)
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
                        f"pliant: other machines need TCP {ports} of {host} open, and this node's store port "
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
                _hand_over(coordinator, etcd, args.node_id)
            return code


def _hand_over(coordinator: CoordinatorServer, etcd: EtcdServer, node: str) -> None:
    """Hand this node's control-plane seat to another node of the job before the run ends
    (:func:`pliant.coordinator.seat_handover.hand_over`); a second signal cuts it short."""
    from pliant.coordinator.seat_handover import hand_over

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    said = lambda line: print(f"pliant: {line}", flush=True)  # noqa: E731
    previous = [signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)]
    try:
        hand_over(coordinator, etcd, node, said)
    except KeyboardInterrupt:
        said("left without handing the control-plane seat over: the control plane ends with this node")
    finally:
        for sig, handler in zip((signal.SIGINT, signal.SIGTERM), previous, strict=True):
            signal.signal(sig, handler)
