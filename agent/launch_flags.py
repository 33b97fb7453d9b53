"""The flags of ``pliant run`` and ``pliant agent``: torchrun's under their torchrun names (dashes or underscores)
where they make sense, refused with the pliant way where they do not, and pliant's own. Defaults that a variable sets
are :mod:`pliant.settings`'; :mod:`pliant.agent.launcher` turns the parsed flags into an agent's config.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pliant import settings
from pliant.agent.contract import state_home
from pliant.env import AUTO
from pliant.flags import add_tls_flags
from pliant.metrics import add_metrics_port_flag

__all__ = ["add_launch_flags", "default_seal_root_file"]


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
    """Add the launch flags of ``pliant run`` (``mode="run"``) or ``pliant agent`` (``mode="agent"``), in the order
    ``--help`` shows them."""
    _job_flags(parser, mode)
    _trust_flags(parser, mode)
    _node_flags(parser)
    _lifecycle_flags(parser)
    _script_flags(parser)


def _job_flags(parser: argparse.ArgumentParser, mode: str) -> None:
    """The job: its size, its restarts, its id and its control plane (with ``pliant run``: the embedded one's address
    and seats)."""
    parser.add_argument(*_names("--nnodes"), default="1:1", help="N or MIN:MAX nodes (default 1:1)")
    parser.add_argument(*_names("--nproc-per-node"), default="1", help="workers per node: N, 'cpu' or 'auto'")
    parser.add_argument(
        *_names("--node-group"),
        type=int,
        default=1,
        help="nodes that train only together, e.g. an hsdp replica cut over 2 nodes: a world holds whole groups, "
        "and a node whose group lost a node waits as a spare (default 1)",
    )
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
        default=settings.JOB.flag_default(),
        help="job id (torchrun: --rdzv-id; env PLIANT_JOB; default 'default')",
    )
    parser.add_argument(
        "--coordinator",
        *_names("--rdzv-endpoint"),
        dest="coordinator",
        default=settings.COORDINATOR.flag_default(),
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
            default=settings.SEAT_KEY.flag_default(),
            help="the embedded control plane's seat key (env PLIANT_SEAT_KEY, the way the first node prints it): "
            "a node that joins with it takes a seat of the control plane while one is free (an etcd member and a "
            "coordinator replica, with the control plane's CA keys); without it a node is a worker node only "
            "(kubeadm join's --certificate-key)",
        )


def _trust_flags(parser: argparse.ArgumentParser, mode: str) -> None:
    """How the node proves who it is: TLS files, or a bootstrap join (the CA's pin and the job's token); with ``pliant
    run``, where the embedded control plane keeps its certificates and its sealing secret."""
    add_tls_flags(parser, "agent")
    parser.add_argument(
        "--ca-cert-hash",
        default=settings.CA_CERT_HASH.flag_default(),
        help="sha256:HEX of the coordinator CA's public key, as the first node's join command prints it (env "
        "PLIANT_CA_CERT_HASH): without --tls-dir the agent joins by bootstrap, pinning that CA before it sends the "
        "join token, making its own key and having its certificate signed (kubeadm join's "
        "--discovery-token-ca-cert-hash)",
    )
    parser.add_argument(
        "--create-job",
        action="store_true",
        help="with --ca-cert-hash and a namespace's join token (pliant k8s namespace): the bootstrap join creates "
        "the job <namespace>.<name> with this node's --nnodes, --nproc-per-node and --max-restarts unless it exists",
    )
    parser.add_argument(
        "--bootstrap",
        default="",
        help="HOST:PORT[,...] of the coordinators' bootstrap service (default: each --coordinator address with its "
        "port + 1)",
    )
    parser.add_argument(
        "--join-token",
        default=settings.JOIN_TOKEN.flag_default(),
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
            default=settings.SEAL_ROOT_FILE.flag_default() or default_seal_root_file(),
            help="the embedded control plane's sealing secret, made on first use (mode 0600): the job's checkpoint "
            "key derives from it, so a run started again on this machine resumes from the checkpoints it sealed; "
            "copy it to start the first node elsewhere (env PLIANT_SEAL_ROOT_FILE; default "
            "$XDG_STATE_HOME/pliant/seal-root, else ~/.local/state/pliant/seal-root)",
        )


def _node_flags(parser: argparse.ArgumentParser) -> None:
    """This node: its checkpoint and log directories, its id, its address and its ports."""
    parser.add_argument(
        "--checkpoint-dir",
        default=settings.CHECKPOINT_DIR.flag_default(),
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


def _lifecycle_flags(parser: argparse.ArgumentParser) -> None:
    """How the job's worlds change and how workers stop: TTLs, graces, the rescale path, buddy copies, hangs."""
    parser.add_argument("--heartbeat-ttl", type=float, default=5.0, help="membership lease TTL, s (default 5)")
    parser.add_argument("--join-grace", type=float, default=1.0, help="join batching window, s (default 1)")
    parser.add_argument(
        "--min-nodes-timeout",
        type=float,
        default=600.0,
        help="how long the job may wait below min nodes before it fails, s (default 600)",
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=settings.STOP_GRACE_S,
        help=f"SIGTERM -> SIGKILL grace for workers, s (default {settings.STOP_GRACE_S:g})",
    )
    parser.add_argument(
        "--abort-grace",
        type=float,
        default=settings.ABORT_GRACE_S,
        help="SIGTERM -> SIGKILL grace for the workers of a world that failed (a worker died, a node was lost): their "
        f"collectives cannot complete, so they can save nothing, s (default {settings.ABORT_GRACE_S:g})",
    )
    parser.add_argument(
        "--rescale-grace",
        type=float,
        default=settings.RESCALE_GRACE_S,
        help=f"how long workers may take to checkpoint and exit on a rescale, s (default {settings.RESCALE_GRACE_S:g})",
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
        default=settings.FINISH_GRACE_S,
        help=f"once the job succeeded, how long this node's workers may take to exit, s (default "
        f"{settings.FINISH_GRACE_S:g})",
    )
    parser.add_argument(
        "--rpc-retry",
        type=float,
        default=10.0,
        help="how long calls to an unreachable coordinator are retried, s (default 10)",
    )


def _script_flags(parser: argparse.ArgumentParser) -> None:
    """The training script: what the zygote preloads, how the script runs, and torchrun's flags (accepted, or refused
    with the pliant way)."""
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


def default_seal_root_file() -> str:
    """Where ``pliant run`` keeps its sealing secret by default: the user's state directory (XDG)."""
    return str(state_home() / "seal-root")
