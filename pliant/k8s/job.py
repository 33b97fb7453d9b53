"""One training job on Kubernetes, rendered from its parameters (pure: no cluster is contacted).

A job is these objects, every name prefixed ``pliant-<job>`` and every object labelled with the job as its
``app.kubernetes.io/instance``, so two jobs side by side share nothing but the control plane:

- **the agents: an elastic Indexed Job** (``pliant-<job>``, ``completionMode: Indexed``, ``parallelism`` =
  ``completions`` = the node count). ``kubectl patch job pliant-<job> -p '{"spec":{"parallelism":N,"completions":N}}'``
  is the elastic knob (Kubernetes' elastic Indexed Jobs: both change together): the Job controller starts the new
  indexes' pods, which join, and deletes the highest indexes' pods, which leave gracefully. Each agent exits with its
  :class:`pliant.agent.contract.ExitCode`, which the pod failure policy reads: the job succeeded (0) completes the
  index, so the Job ends Completed once the training job has; the job failed (1) fails the Job at once; a graceful
  leave on SIGTERM (143: a deletion, a drain, a preemption) and a pod disrupted by Kubernetes (``DisruptionTarget``)
  are ignored, so the index's pod is replaced and the node joins again; anything else (an agent error, 2; a kill)
  counts against ``backoffLimit``. ``restartPolicy: Never``: nothing crash-loops.
- **no per-pod certificate**: each agent gets its own by the bootstrap join (``--ca-cert-hash`` pins the control
  plane's CA; the job's token, from the Secret ``pliant-<job>-token``, proves it may join);
- the **Job that creates the training job** (``pliant-<job>-create``, an admin, idempotent: creating an identical job
  again is a no-op), with the same node range and workers per node as the agents;
- the **checkpoint volume** (a ReadWriteMany claim ``pliant-<job>-checkpoints``, or a claim the operator names, in
  which the job writes under ``<job>/``), the **NetworkPolicy** that lets only this job's agents reach each other's
  stores and gloo ports (and monitoring their metrics), the **PodDisruptionBudget** (one agent down at a time: each
  drain is one graceful leave), and, with ``script``, a ConfigMap holding the training script.

The grace a deleted pod gets (``terminationGracePeriodSeconds``) covers the agent's whole stop: the workers' hand-over
at the next step boundary within ``--rescale-grace``, the stack dump, ``--stop-grace`` after SIGTERM and the reap after
SIGKILL (:mod:`pliant.agent.stopping`), so a drained node's survivors lose no step.
"""

from __future__ import annotations

import math
import re
import secrets
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pliant import settings
from pliant.agent.contract import ExitCode, left_on
from pliant.agent.stopping import DUMP_S, KILL_REAP_S
from pliant.errors import ConfigError
from pliant.k8s import names
from pliant.k8s.names import labels, selector

__all__ = ["SCRIPT_DIR", "JobUnit", "render_job"]

SCRIPT_DIR = "/opt/pliant/script"  # where a job's script ConfigMap is mounted
_JOB_ID = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")  # a DNS label that leaves room for the prefixes
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?")
_CA_HASH = re.compile(r"sha256:[0-9a-f]{64}")
_LEAVE_SLACK_S = 10.0  # the Leave call, and the agent's own exit, after its workers are gone


def _securely(spec: dict[str, Any]) -> dict[str, Any]:
    """A pod spec with the hardening every pliant pod has: non-root, RuntimeDefault seccomp, no service-account
    token."""
    return {
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **spec,
    }


_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


@dataclass(frozen=True)
class JobUnit:
    """A training job's parameters (``pliant k8s job``'s flags).

    Attributes:
        job_id: the job id: a DNS label of at most 40 characters (it prefixes every object's name).
        image: the pliant image the agents (and the creating Job) run.
        command: the training script and its arguments, as ``pliant run`` takes them (with ``script``: the
            arguments only).
        ca_cert_hash: ``sha256:<hex>`` of the control plane's CA (``pliant certs fingerprint``).
        min_nodes: the job's minimum node count.
        max_nodes: its maximum.
        nodes: agent pods to start with (the Job's parallelism and completions); default ``max_nodes``.
        nproc_per_node: workers per node.
        namespace: the control plane's namespace, where the job goes too.
        script: a local training script to ship in a ConfigMap (else the script is in the image).
        cpu: CPU per agent pod (request and limit).
        memory: memory per agent pod (request and limit).
        gpus: ``nvidia.com/gpu`` per agent pod.
        shm_size: the pod's ``/dev/shm`` (the workers' buddy copies; about 2x a rank's shard plus its wards').
        checkpoint_claim: an existing ReadWriteMany claim to write checkpoints in (under ``<job>/``); "" makes one.
        checkpoint_size: the size of the claim made.
        storage_class: its storage class ("" : the cluster's default).
        token: the job's join token ("" : a random one).
        token_secret: an existing Secret (key ``token``) holding the join token; "" renders one.
        rescale_grace_s: the agents' ``--rescale-grace``.
        stop_grace_s: the agents' ``--stop-grace``.
        max_restarts: worker failures the job survives (``pliant job create --max-restarts``).
    """

    job_id: str
    image: str
    command: tuple[str, ...]
    ca_cert_hash: str
    min_nodes: int = 1
    max_nodes: int = 1
    nodes: int = 0
    nproc_per_node: int = 1
    namespace: str = names.NAMESPACE
    script: Path | None = None
    cpu: str = "2"
    memory: str = "8Gi"
    gpus: int = 0
    shm_size: str = "1Gi"
    checkpoint_claim: str = ""
    checkpoint_size: str = "20Gi"
    storage_class: str = ""
    token: str = field(default="", repr=False)
    token_secret: str = ""
    rescale_grace_s: float = settings.RESCALE_GRACE_S
    stop_grace_s: float = settings.STOP_GRACE_S
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if not _JOB_ID.fullmatch(self.job_id):
            raise ConfigError(
                f"job id {self.job_id!r} must be a DNS label of at most 40 characters (lowercase letters, digits and "
                f"'-', starting and ending with a letter or digit), e.g. 'gpt-small'"
            )
        if not self.image:
            raise ConfigError(
                "--image is required: the pliant image the agents run (docker build -f deploy/Dockerfile)"
            )
        if not self.command and self.script is None:
            raise ConfigError(
                "no training script: pass it after the flags (-- /app/train.py --lr 0.1) or --script FILE"
            )
        if not _CA_HASH.fullmatch(self.ca_cert_hash):
            raise ConfigError(
                f"--ca-cert-hash {self.ca_cert_hash!r} must be sha256:<64 hex digits>; pass --ca-cert pki/ca.crt "
                f"or the output of `pliant certs fingerprint --certs-dir pki`"
            )
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"--nnodes {self.min_nodes}:{self.max_nodes} must be MIN:MAX with 1 <= MIN <= MAX")
        if self.nodes < 0 or self.nproc_per_node < 1 or self.gpus < 0:
            raise ConfigError(
                f"--nodes {self.nodes}, --nproc-per-node {self.nproc_per_node} and --gpus {self.gpus} must be >= 0, "
                f">= 1 and >= 0"
            )
        for flag, value in (("--cpu", self.cpu), ("--memory", self.memory), ("--shm-size", self.shm_size)):
            if not _QUANTITY.fullmatch(value):
                raise ConfigError(f"{flag} {value!r} is not a Kubernetes quantity, e.g. 2, 500m, 8Gi")
        if self.script is not None and not self.script.is_file():
            raise ConfigError(f"--script {self.script} is not a file")
        if self.rescale_grace_s <= 0 or self.stop_grace_s <= 0:
            raise ConfigError("--rescale-grace and --stop-grace must be > 0 seconds")

    @property
    def name(self) -> str:
        """The prefix of every object's name."""
        return f"pliant-{self.job_id}"

    @property
    def pods(self) -> int:
        return self.nodes or self.max_nodes

    @property
    def termination_grace_s(self) -> int:
        """What a deleted agent pod needs to leave gracefully (see the module docstring)."""
        return math.ceil(self.rescale_grace_s + DUMP_S + self.stop_grace_s + KILL_REAP_S + _LEAVE_SLACK_S)


def render_job(unit: JobUnit) -> list[dict[str, Any]]:
    """Every object of ``unit``'s job, in the order ``kubectl apply`` should create them."""
    token_secret = unit.token_secret or f"{unit.name}-token"
    claim = unit.checkpoint_claim or f"{unit.name}-checkpoints"
    objects: list[dict[str, Any]] = []
    if not unit.token_secret:
        objects.append(_token_secret(unit, token_secret))
    if unit.script is not None:
        objects.append(_script_config_map(unit))
    if not unit.checkpoint_claim:
        objects.append(_claim(unit, claim))
    objects += [
        _network_policy(unit),
        _disruption_budget(unit),
        _creator(unit, token_secret),
        _agents(unit, token_secret, claim),
    ]
    return objects


def _meta(unit: JobUnit, name: str, component: str, app: str = names.AGENT) -> dict[str, Any]:
    return {"name": name, "namespace": unit.namespace, "labels": labels(app, unit.job_id, component)}


def _token_secret(unit: JobUnit, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(unit, name, "join-token"),
        "type": "Opaque",
        "stringData": {"token": unit.token or secrets.token_urlsafe(32)},
    }


def _script_config_map(unit: JobUnit) -> dict[str, Any]:
    assert unit.script is not None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(unit, f"{unit.name}-script", "script"),
        "data": {unit.script.name: unit.script.read_text()},
    }


def _claim(unit: JobUnit, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],  # every agent saves its shards to and restores from the same directory
        "resources": {"requests": {"storage": unit.checkpoint_size}},
    }
    if unit.storage_class:
        spec["storageClassName"] = unit.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(unit, name, "checkpoints"),
        "spec": spec,
    }


def _network_policy(unit: JobUnit) -> dict[str, Any]:
    """Only this job's agents reach its agents (the agent store, the generation store and gloo listen on ports chosen
    at run time and have no authentication); monitoring scrapes their metrics."""
    own = {"podSelector": {"matchLabels": selector(names.AGENT, unit.job_id)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(unit, f"{unit.name}-agents", "agent"),
        "spec": {
            **own,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [own]},
                {
                    "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                    "ports": [{"port": names.METRICS_PORT, "protocol": "TCP"}],
                },
            ],
        },
    }


def _disruption_budget(unit: JobUnit) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(unit, unit.name, "agent"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(names.AGENT, unit.job_id)}},
    }


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    amount: dict[str, Any] = {"cpu": cpu, "memory": memory}
    limits = {**amount, "nvidia.com/gpu": gpus} if gpus else dict(amount)
    return {"requests": amount, "limits": limits}


def _creator(unit: JobUnit, token_secret: str) -> dict[str, Any]:
    """The admin's Job that creates the training job with its token: idempotent, and retried while the control plane
    starts."""
    meta = _meta(unit, f"{unit.name}-create", "job-creator", names.ADMIN)
    container = {
        "name": "create",
        "image": unit.image,
        "command": ["pliant", "job", "create"],
        "args": [
            unit.job_id,
            f"--coordinator={names.COORDINATOR}:{names.API_PORT}",
            "--tls-dir=/etc/pliant/admin",
            f"--nnodes={unit.min_nodes}:{unit.max_nodes}",
            f"--nproc-per-node={unit.nproc_per_node}",
            f"--max-restarts={unit.max_restarts}",
            "--join-token-file=/etc/pliant/token/token",
        ],
        "securityContext": _CONTAINER_SECURITY,
        "resources": _resources("100m", "256Mi"),
        "volumeMounts": [
            {"name": "admin-tls", "mountPath": "/etc/pliant/admin", "readOnly": True},
            {"name": "token", "mountPath": "/etc/pliant/token", "readOnly": True},
        ],
    }
    pod = _securely(
        {
            "restartPolicy": "OnFailure",
            "containers": [container],
            "volumes": [
                {"name": "admin-tls", "secret": {"secretName": names.ADMIN_TLS, "defaultMode": 0o440}},
                {"name": "token", "secret": {"secretName": token_secret, "defaultMode": 0o440}},
            ],
        }
    )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 20,
            "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": meta["labels"]}, "spec": pod},
        },
    }


def _agents(unit: JobUnit, token_secret: str, claim: str) -> dict[str, Any]:
    """The agents: an elastic Indexed Job (see the module docstring)."""
    meta = _meta(unit, unit.name, "agent")
    command = list(unit.command)
    if unit.script is not None:
        command = [f"{SCRIPT_DIR}/{unit.script.name}", *command]
    coordinator = f"{names.COORDINATOR}:{names.API_PORT}"
    probe = {"httpGet": {"path": "/healthz", "port": "metrics"}}
    mounts = [
        {"name": "checkpoints", "mountPath": "/checkpoints"},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}},
        # the workers' buddy copies (--snapshot-dir, /dev/shm): without room there they stay in process memory
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": unit.shm_size}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    if unit.script is not None:
        mounts.append({"name": "script", "mountPath": SCRIPT_DIR, "readOnly": True})
        volumes.append({"name": "script", "configMap": {"name": f"{unit.name}-script"}})
    container = {
        "name": "agent",
        "image": unit.image,
        "command": ["pliant", "agent"],
        "args": [
            f"--coordinator={coordinator}",
            f"--bootstrap={names.COORDINATOR}:{names.BOOTSTRAP_PORT}",
            f"--ca-cert-hash={unit.ca_cert_hash}",
            f"--job={unit.job_id}",
            f"--nnodes={unit.min_nodes}:{unit.max_nodes}",
            f"--nproc-per-node={unit.nproc_per_node}",
            "--node-id=$(POD_NAME)",
            "--host=$(POD_IP)",
            f"--metrics-port={names.METRICS_PORT}",
            f"--checkpoint-dir=/checkpoints/{unit.job_id}",
            f"--rescale-grace={unit.rescale_grace_s:g}",
            f"--stop-grace={unit.stop_grace_s:g}",
            *command,
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PLIANT_JOIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "token"}}},
            {"name": "PLIANT_LOG_LEVEL", "value": "INFO"},
            {"name": "HOME", "value": "/tmp"},
        ],
        "ports": [{"name": "metrics", "containerPort": names.METRICS_PORT}],
        # The join and the zygote's torch import may take minutes on a cold node; then the loop must keep ticking.
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": 120},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "securityContext": _CONTAINER_SECURITY,
        "resources": _resources(unit.cpu, unit.memory, unit.gpus),
        "volumeMounts": mounts,
    }
    exits = [
        {
            "action": "FailJob",  # the training job failed: so does this Job
            "onExitCodes": {"containerName": "agent", "operator": "In", "values": [int(ExitCode.JOB_FAILED)]},
        },
        {
            "action": "Ignore",  # left gracefully (deleted, drained, preempted): the index gets a new pod
            "onExitCodes": {
                "containerName": "agent",
                "operator": "In",
                "values": sorted([left_on(signal.SIGTERM), left_on(signal.SIGINT)]),  # the API wants them in order
            },
        },
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
    pod = _securely(
        {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": unit.termination_grace_s,
            "containers": [container],
            "volumes": volumes,
        }
    )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": unit.pods,
            "parallelism": unit.pods,
            "backoffLimit": 6,
            "podFailurePolicy": {"rules": exits},
            "template": {"metadata": {"labels": meta["labels"]}, "spec": pod},
        },
    }
