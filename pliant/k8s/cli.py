"""``pliant k8s``: print the Kubernetes objects of the control plane's Secrets and of a training job, for
``kubectl apply -f -``.

- ``pliant k8s secrets --dir pki``: make the control plane's certificates where missing (:mod:`pliant.k8s.secrets`)
  and print its Secrets; the CA fingerprint the jobs pin goes to stderr.
- ``pliant k8s namespace --namespace team-a --coordinator HOST:PORT --tls-dir pki/admin``: register the namespace's
  join token with the control plane (an admin's call, from the operator's machine) and print its Secret
  ``pliant-join``, once per namespace; the namespace's agents create their jobs with it.
- ``pliant k8s trainer-runtime --image IMG --ca-cert pki/ca.crt``: print the Kubeflow Trainer ClusterTrainingRuntime
  ``pliant`` (:mod:`pliant.k8s.trainer`): TrainJobs that name it train under pliant's agents.
- ``pliant k8s job --namespace team-a --job ID --image IMG --nnodes MIN:MAX --nproc-per-node N --ca-cert pki/ca.crt
  SCRIPT ARGS``: print one training job's objects (:mod:`pliant.k8s.job`, pure: the same flags print the same bytes);
  the job's flags are ``pliant run``'s, and so is the script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pliant import settings
from pliant.errors import ConfigError
from pliant.flags import add_tls_flags
from pliant.k8s import names

__all__ = ["add_k8s_commands", "k8s_main"]


def add_k8s_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``pliant k8s ...`` to the top-level subcommands."""
    k8s = sub.add_parser(
        "k8s",
        help="print Kubernetes manifests: the control plane's Secrets, a training job",
        description="Print Kubernetes objects for `kubectl apply -f -`. The control plane itself is `kubectl apply -k "
        "deploy/`; see docs/operations.md.",
    )
    actions = k8s.add_subparsers(dest="k8s_command", metavar="ACTION", required=True)
    secrets = actions.add_parser(
        "secrets",
        help="make the control plane's certificates (where missing) and print its Secrets",
        allow_abbrev=False,
    )
    secrets.add_argument("--dir", required=True, help="where the certificates and keys are kept (created 0700)")
    secrets.add_argument(
        "--namespace", default=names.NAMESPACE, help=f"the control plane's (default {names.NAMESPACE})"
    )
    secrets.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="HOST",
        help="another name or address for the coordinators' and etcd's certificates (repeatable)",
    )
    namespace = actions.add_parser(
        "namespace",
        help="register a namespace's join token with the control plane and print its Secret (admin; once per "
        "namespace)",
        allow_abbrev=False,
    )
    namespace.add_argument("--namespace", required=True, help="the job namespace (a team's)")
    namespace.add_argument(
        "--coordinator",
        default=settings.COORDINATOR.flag_default() or settings.DEFAULT_COORDINATOR,
        help="a coordinator HOST:PORT reachable from here, e.g. localhost:29400 through `kubectl -n pliant "
        "port-forward svc/pliant-coordinator 29400` (env PLIANT_COORDINATOR)",
    )
    add_tls_flags(namespace, "admin")
    namespace.add_argument(
        "--checkpoint-size",
        default="",
        help=f"also print the namespace's ReadWriteMany claim {names.CHECKPOINT_CLAIM} of this size, where its "
        "TrainJobs (pliant k8s trainer-runtime) keep their checkpoints",
    )
    namespace.add_argument("--storage-class", default="", help="that claim's class, one that binds ReadWriteMany")
    namespace.add_argument(
        "--rotate",
        action="store_true",
        help="replace the namespace's token (its jobs take the new one; apply the Secret printed at once)",
    )
    runtime = actions.add_parser(
        "trainer-runtime",
        help="print the Kubeflow Trainer ClusterTrainingRuntime whose TrainJobs train under pliant's agents",
        allow_abbrev=False,
    )
    runtime.add_argument("--image", required=True, help="the pliant image (deploy/Dockerfile) with the training code")
    _add_control_plane(runtime)
    runtime.add_argument("--name", default="pliant", help="the runtime's name, which TrainJobs name (default pliant)")
    runtime.add_argument("--shm-size", default="1Gi", help="/dev/shm per pod (default 1Gi)")
    runtime.add_argument("--max-restarts", type=int, default=3, help="worker failures a job survives (default 3)")
    job = actions.add_parser(
        "job",
        help="print one training job in its namespace: its agents (an elastic Indexed Job), checkpoint volume, "
        "NetworkPolicy and PodDisruptionBudget",
        allow_abbrev=False,
    )
    job.add_argument(
        "--job",
        required=True,
        help="the job's name in its namespace, a DNS label (it prefixes every object's name; the control plane knows "
        "the job as NAMESPACE.JOB)",
    )
    job.add_argument("--image", required=True, help="the pliant image (deploy/Dockerfile) with the training code")
    job.add_argument("--nnodes", default="1:1", help="N or MIN:MAX nodes, as pliant run takes it (default 1:1)")
    job.add_argument("--nodes", type=int, default=0, help="agent pods to start with, MIN to MAX (default MAX)")
    job.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    _add_control_plane(job)
    job.add_argument("--script", type=Path, default=None, help="a local training script, shipped in a ConfigMap")
    job.add_argument("--namespace", default="default", help="the job's namespace, its team's (default: default)")
    job.add_argument("--cpu", default="2", help="CPU per agent pod, request and limit (default 2)")
    job.add_argument("--memory", default="8Gi", help="memory per agent pod, request and limit (default 8Gi)")
    job.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu per agent pod, one per worker (default 0)")
    job.add_argument("--shm-size", default="1Gi", help="/dev/shm per pod, for the buddy copies (default 1Gi)")
    job.add_argument(
        "--node-selector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label the agents' nodes must have, e.g. a GPU pool's (repeatable)",
    )
    job.add_argument(
        "--toleration",
        action="append",
        default=[],
        metavar="KEY[=VALUE]:EFFECT",
        help="a taint the agents tolerate, e.g. nvidia.com/gpu:NoSchedule (repeatable)",
    )
    job.add_argument("--checkpoint-claim", default="", help="an existing ReadWriteMany claim (default: make one)")
    job.add_argument("--checkpoint-size", default="20Gi", help="the size of the claim made (default 20Gi)")
    job.add_argument(
        "--storage-class",
        default="",
        help="the claim's storage class, one that binds ReadWriteMany (NFS, CephFS, EFS, Filestore, Azure Files; "
        "default: the cluster's default class)",
    )
    job.add_argument(
        "--token-secret",
        default="",
        help="a Secret (key `token`) with the join token of a job an admin created (pliant job create "
        "NAMESPACE.JOB); default: the namespace's Secret pliant-join, with which the agents create the job",
    )
    job.add_argument(
        "--rescale-grace",
        type=float,
        default=settings.RESCALE_GRACE_S,
        help=f"the agents' --rescale-grace, s (default {settings.RESCALE_GRACE_S:g})",
    )
    job.add_argument(
        "--stop-grace",
        type=float,
        default=settings.STOP_GRACE_S,
        help=f"the agents' --stop-grace, s (default {settings.STOP_GRACE_S:g})",
    )
    job.add_argument("--max-restarts", type=int, default=3, help="worker failures the job survives (default 3)")
    job.add_argument(
        "training",
        metavar="SCRIPT ...",
        nargs=argparse.REMAINDER,
        help="the training script and its arguments, after the flags as with pliant run (with --script: the arguments)",
    )
    k8s.set_defaults(func=k8s_main)


def _add_control_plane(parser: argparse.ArgumentParser) -> None:
    """The flags that name the control plane: its CA's pin and its namespace."""
    pin = parser.add_mutually_exclusive_group(required=True)
    pin.add_argument("--ca-cert", help="the control plane's CA certificate (pki/ca.crt), whose fingerprint agents pin")
    pin.add_argument("--ca-cert-hash", help="its fingerprint, sha256:<hex> (pliant certs fingerprint)")
    parser.add_argument(
        "--control-plane-namespace",
        default=names.NAMESPACE,
        help=f"where deploy/ installed the control plane (default {names.NAMESPACE})",
    )


def _dump(objects: list[dict[str, Any]]) -> str:
    """YAML documents, every value written out where it is (no anchors and aliases for values used twice)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(objects, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)


def _ca_hash(args: argparse.Namespace) -> str:
    """The CA pin from --ca-cert (its fingerprint) or --ca-cert-hash."""
    from pliant.security.identity import ca_fingerprint

    if not args.ca_cert:
        return str(args.ca_cert_hash)
    try:
        return ca_fingerprint(Path(args.ca_cert).read_bytes())
    except OSError as exc:
        raise ConfigError(f"--ca-cert {args.ca_cert}: {exc.strerror}; pass the CA pliant k8s secrets made") from exc


def k8s_main(args: argparse.Namespace) -> int:
    """Print what ``args`` asks for on stdout.

    Raises:
        ConfigError: a flag's value is unusable (the message names it and the fix).
    """
    from pliant.coordinator.contract import parse_node_range
    from pliant.k8s.job import JobUnit, render_job
    from pliant.k8s.secrets import ControlPlanePki, render_secrets
    from pliant.security.identity import ca_fingerprint

    if args.k8s_command == "secrets":
        pki = ControlPlanePki.ensure(args.dir, args.namespace, args.san)
        sys.stdout.write(_dump(render_secrets(pki, args.namespace)))
        print(
            f"pliant k8s secrets: certificates in {pki.directory}; jobs pin the CA with --ca-cert {pki.ca_cert} "
            f"(--ca-cert-hash {ca_fingerprint(pki.ca_cert.read_bytes())})",
            file=sys.stderr,
        )
        return 0
    if args.k8s_command == "namespace":
        return _namespace(args)
    if args.k8s_command == "trainer-runtime":
        from pliant.k8s.trainer import TrainerRuntime, render_trainer_runtime

        runtime = TrainerRuntime(
            image=args.image,
            ca_cert_hash=_ca_hash(args),
            name=args.name,
            control_plane_namespace=args.control_plane_namespace,
            shm_size=args.shm_size,
            max_restarts=args.max_restarts,
        )
        sys.stdout.write(_dump([render_trainer_runtime(runtime)]))
        return 0
    command = list(args.training)
    if command[:1] == ["--"]:
        command = command[1:]
    ca_hash = _ca_hash(args)
    low, high = parse_node_range(args.nnodes)
    unit = JobUnit(
        job_id=args.job,
        image=args.image,
        command=tuple(command),
        ca_cert_hash=ca_hash,
        min_nodes=low,
        max_nodes=high,
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        namespace=args.namespace,
        control_plane_namespace=args.control_plane_namespace,
        script=args.script,
        cpu=args.cpu,
        memory=args.memory,
        gpus=args.gpus,
        shm_size=args.shm_size,
        checkpoint_claim=args.checkpoint_claim,
        checkpoint_size=args.checkpoint_size,
        storage_class=args.storage_class,
        token_secret=args.token_secret,
        rescale_grace_s=args.rescale_grace,
        stop_grace_s=args.stop_grace,
        max_restarts=args.max_restarts,
        node_selector=tuple(args.node_selector),
        tolerations=tuple(args.toleration),
    )
    sys.stdout.write(_dump(render_job(unit)))
    return 0


def _namespace(args: argparse.Namespace) -> int:
    """``pliant k8s namespace``: register the namespace's token, print its Secret; 1 when the coordinator refuses."""
    from pliant.coordinator.client import CoordinatorClient
    from pliant.coordinator.contract import CoordinatorError
    from pliant.flags import tls_from_flags
    from pliant.k8s.secrets import checkpoint_claim, join_secret

    if not names.is_namespace(args.namespace):
        raise ConfigError(f"--namespace {args.namespace!r} is not a namespace's name (a DNS label), e.g. team-a")
    tls = tls_from_flags(args.tls_dir, args.insecure, "k8s namespace")
    client = CoordinatorClient(args.coordinator, tls.load() if tls else None, retry_for_s=5.0)
    try:
        token, _changed = client.set_namespace_token(args.namespace, rotate=args.rotate)
    except CoordinatorError as exc:
        print(f"pliant k8s namespace: error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    objects = [join_secret(args.namespace, token)]
    if args.checkpoint_size:
        objects.append(checkpoint_claim(args.namespace, args.checkpoint_size, args.storage_class))
    sys.stdout.write(_dump(objects))
    print(
        f"pliant k8s namespace: {args.namespace}'s join token registered; apply the Secret above in {args.namespace} "
        f"(it is printed only now), then render its jobs with pliant k8s job --namespace {args.namespace}",
        file=sys.stderr,
    )
    return 0
