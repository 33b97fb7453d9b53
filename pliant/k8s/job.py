"""One training job on Kubernetes, rendered from its parameters (pure: no cluster is contacted, and the same
parameters render the same bytes).

A job lives in a namespace its team owns; the control plane lives in its own (``pliant`` by default), and nothing of
it is mounted, referenced or granted in the job's namespace. A job is these objects, every name prefixed
``pliant-<job>`` and every object labelled with the job as its ``app.kubernetes.io/instance``, so two jobs side by
side share nothing but the control plane:

- **the agents: an elastic Indexed Job** (``pliant-<job>``, ``completionMode: Indexed``, ``parallelism`` =
  ``completions`` = the node count). ``kubectl patch job pliant-<job> -p '{"spec":{"parallelism":N,"completions":N}}'``
  is the elastic knob (Kubernetes' elastic Indexed Jobs: both change together): the Job controller starts the new
  indexes' pods, which join, and deletes the highest indexes' pods, which leave gracefully. Each agent exits with its
  :class:`pliant.agent.contract.ExitCode`, which the pod failure policy reads: the job succeeded (0) completes the
  index, so the Job ends Completed once the training job has; the job failed (1) fails the Job at once; a graceful
  leave on SIGTERM (143: a deletion, a drain, a preemption) and a pod disrupted by Kubernetes (``DisruptionTarget``)
  are ignored, so the index's pod is replaced and the node joins again; anything else (an agent error, 2; a kill)
  counts against ``backoffLimit``. ``restartPolicy: Never``: nothing crash-loops.
- **no certificate and no per-job Secret**: each agent gets its certificate by the bootstrap join (``--ca-cert-hash``
  pins the control plane's CA) with the namespace's join token (the Secret ``pliant-join`` that ``pliant k8s
  namespace`` printed once for the namespace), and that join creates the job ``<namespace>.<job>`` in the control
  plane unless it exists (``--create-job``, identical specs: a no-op), so no admin key is in the cluster. With
  ``token_secret`` the agents join a job an admin created (``pliant job create``) with that job's own token instead.
- the **checkpoint volume** (a ReadWriteMany claim ``pliant-<job>-checkpoints`` of ``storage_class``, or a claim the
  operator names, in which the job writes under ``<job>/``), the **NetworkPolicy** that lets only this job's agents
  reach each other's stores and gloo ports (and monitoring their metrics), the **PodDisruptionBudget** (one agent down
  at a time: each drain is one graceful leave), and, with ``script``, a ConfigMap holding the training script.

The agents reach the coordinators by their Service's namespaced name (``pliant-coordinator.<control plane
namespace>.svc``), which their certificate names. The grace a deleted pod gets (``terminationGracePeriodSeconds``)
covers the agent's whole stop: the workers' hand-over at the next step boundary within ``--rescale-grace``, the stack
dump, ``--stop-grace`` after SIGTERM and the reap after SIGKILL (:mod:`pliant.agent.stopping`), so a drained node's
survivors lose no step.
"""

from __future__ import annotations

import math
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pliant import settings
from pliant.agent.contract import ExitCode, left_on
from pliant.agent.stopping import DUMP_S, KILL_REAP_S
from pliant.errors import ConfigError
from pliant.k8s import names
from pliant.k8s.names import labels, selector

__all__ = [
    "CONTAINER_SECURITY",
    "LEAVE_SLACK_S",
    "SCRIPT_DIR",
    "JobUnit",
    "agent_pod_parts",
    "failure_policy",
    "hardened",
    "render_job",
    "resources",
]

SCRIPT_DIR = "/opt/pliant/script"  # where a job's script ConfigMap is mounted
_JOB_ID = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")  # a DNS label that leaves room for the prefixes
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?")
_CA_HASH = re.compile(r"sha256:[0-9a-f]{64}")
_LABEL_KEY = r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_SELECTOR = re.compile(rf"{_LABEL_KEY}={_LABEL_VALUE}")
_TOLERATION = re.compile(rf"{_LABEL_KEY}(={_LABEL_VALUE})?:(NoSchedule|PreferNoSchedule|NoExecute)")
LEAVE_SLACK_S = 10.0  # the Leave call, and the agent's own exit, after its workers are gone


def hardened(spec: dict[str, Any]) -> dict[str, Any]:
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


CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


@dataclass(frozen=True)
class JobUnit:
    """A training job's parameters (``pliant k8s job``'s flags).

    Attributes:
        job_id: the job's name in its namespace: a DNS label of at most 40 characters (it prefixes every object's
            name); the control plane knows the job as ``<namespace>.<job_id>``.
        image: the pliant image the agents run.
        command: the training script and its arguments, as ``pliant run`` takes them (with ``script``: the
            arguments only).
        ca_cert_hash: ``sha256:<hex>`` of the control plane's CA (``pliant certs fingerprint``).
        min_nodes: the job's minimum node count.
        max_nodes: its maximum.
        nodes: agent pods to start with (the Job's parallelism and completions), from ``min_nodes`` to
            ``max_nodes``; default ``max_nodes``.
        nproc_per_node: workers per node.
        namespace: the job's namespace (its team's).
        control_plane_namespace: the control plane's namespace (``deploy/``'s).
        script: a local training script to ship in a ConfigMap (else the script is in the image).
        cpu: CPU per agent pod (request and limit).
        memory: memory per agent pod (request and limit).
        gpus: ``nvidia.com/gpu`` per agent pod: one per worker, so 0 or ``nproc_per_node``.
        shm_size: the pod's ``/dev/shm`` (the workers' buddy copies; about 2x a rank's shard plus its wards').
        checkpoint_claim: an existing ReadWriteMany claim to write checkpoints in (under ``<job>/``); "" makes one.
        checkpoint_size: the size of the claim made.
        storage_class: its storage class ("" : the cluster's default), one that binds ReadWriteMany.
        token_secret: a Secret (key ``token``) holding the join token of a job an admin created; "": the
            namespace's (``pliant-join``), with which the agents create the job.
        rescale_grace_s: the agents' ``--rescale-grace``.
        stop_grace_s: the agents' ``--stop-grace``.
        max_restarts: worker failures the job survives.
        node_selector: ``KEY=VALUE`` labels the agents' nodes must have (``--node-selector``, e.g. a GPU pool's).
        tolerations: taints the agents tolerate, ``KEY[=VALUE]:EFFECT`` (``--toleration``, e.g.
            ``nvidia.com/gpu:NoSchedule``).
    """

    job_id: str
    image: str
    command: tuple[str, ...]
    ca_cert_hash: str
    min_nodes: int = 1
    max_nodes: int = 1
    nodes: int = 0
    nproc_per_node: int = 1
    namespace: str = "default"
    control_plane_namespace: str = names.NAMESPACE
    script: Path | None = None
    cpu: str = "2"
    memory: str = "8Gi"
    gpus: int = 0
    shm_size: str = "1Gi"
    checkpoint_claim: str = ""
    checkpoint_size: str = "20Gi"
    storage_class: str = ""
    token_secret: str = ""
    rescale_grace_s: float = settings.RESCALE_GRACE_S
    stop_grace_s: float = settings.STOP_GRACE_S
    max_restarts: int = 3
    node_selector: tuple[str, ...] = ()
    tolerations: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for item in self.node_selector:
            if not _SELECTOR.fullmatch(item):
                raise ConfigError(
                    f"--node-selector {item!r} must be KEY=VALUE with a label's key and value, e.g. "
                    f"cloud.google.com/gke-accelerator=nvidia-h100-80gb"
                )
        for item in self.tolerations:
            if not _TOLERATION.fullmatch(item):
                raise ConfigError(
                    f"--toleration {item!r} must be KEY[=VALUE]:EFFECT with EFFECT NoSchedule, PreferNoSchedule or "
                    f"NoExecute, e.g. nvidia.com/gpu:NoSchedule"
                )
        if not _JOB_ID.fullmatch(self.job_id):
            raise ConfigError(
                f"job id {self.job_id!r} must be a DNS label of at most 40 characters (lowercase letters, digits and "
                f"'-', starting and ending with a letter or digit), e.g. 'gpt-small'"
            )
        for flag, value in (
            ("--namespace", self.namespace),
            ("--control-plane-namespace", self.control_plane_namespace),
        ):
            if not names.is_namespace(value):
                raise ConfigError(f"{flag} {value!r} is not a Kubernetes namespace's name (a DNS label), e.g. team-a")
        if self.namespace == self.control_plane_namespace:
            raise ConfigError(
                f"--namespace {self.namespace} is the control plane's: run jobs in a namespace of their own (their "
                f"team's), where no Secret of the control plane is"
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
        if self.nodes > self.max_nodes:
            raise ConfigError(
                f"--nodes {self.nodes} is more than --nnodes {self.min_nodes}:{self.max_nodes} admits: "
                f"{self.nodes - self.max_nodes} pods would wait as spares for as long as the job runs; pass --nodes "
                f"{self.max_nodes} or less, or raise the maximum"
            )
        if 0 < self.nodes < self.min_nodes:
            raise ConfigError(
                f"--nodes {self.nodes} is fewer than --nnodes {self.min_nodes}:{self.max_nodes} needs: the job would "
                f"never start; pass --nodes {self.min_nodes} or more"
            )
        if self.gpus and self.gpus != self.nproc_per_node:
            raise ConfigError(
                f"--gpus {self.gpus} with --nproc-per-node {self.nproc_per_node}: each worker drives one GPU of its "
                f"pod, so pass --nproc-per-node {self.gpus} (or --gpus {self.nproc_per_node})"
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
    def control_plane_job_id(self) -> str:
        """The job's id in the control plane: ``<namespace>.<job>`` (a namespace's token creates only those)."""
        return f"{self.namespace}.{self.job_id}"

    @property
    def pods(self) -> int:
        return self.nodes or self.max_nodes

    @property
    def termination_grace_s(self) -> int:
        """What a deleted agent pod needs to leave gracefully (see the module docstring)."""
        return math.ceil(self.rescale_grace_s + DUMP_S + self.stop_grace_s + KILL_REAP_S + LEAVE_SLACK_S)


def render_job(unit: JobUnit) -> list[dict[str, Any]]:
    """Every object of ``unit``'s job, in the order ``kubectl apply`` should create them."""
    claim = unit.checkpoint_claim or f"{unit.name}-checkpoints"
    objects: list[dict[str, Any]] = []
    if unit.script is not None:
        objects.append(_script_config_map(unit))
    if not unit.checkpoint_claim:
        objects.append(_claim(unit, claim))
    objects += [_network_policy(unit), _disruption_budget(unit), _agents(unit, claim)]
    return objects


def _meta(unit: JobUnit, name: str, component: str, app: str = names.AGENT) -> dict[str, Any]:
    return {"name": name, "namespace": unit.namespace, "labels": labels(app, unit.job_id, component)}


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


def resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    amount: dict[str, Any] = {"cpu": cpu, "memory": memory}
    limits = {**amount, "nvidia.com/gpu": gpus} if gpus else dict(amount)
    return {"requests": amount, "limits": limits}


def agent_pod_parts(
    token_secret: str, limits: dict[str, Any], mounts: list[dict[str, Any]], env: tuple[dict[str, Any], ...] = ()
) -> dict[str, Any]:
    """What every agent container has besides its name, image and command: the downward-API values and ``env``, its
    join token from Secret ``token_secret``, the metrics port and the probes on its ``/healthz``, the hardening,
    ``limits`` (requests and limits) and ``mounts``."""
    probe = {"httpGet": {"path": "/healthz", "port": "metrics"}}
    return {
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *env,
            {"name": "PLIANT_JOIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "token"}}},
            {"name": "PLIANT_LOG_LEVEL", "value": "INFO"},
            {"name": "HOME", "value": "/tmp"},
        ],
        "ports": [{"name": "metrics", "containerPort": names.METRICS_PORT}],
        # The join and the zygote's torch import may take minutes on a cold node; then the loop must keep ticking.
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": 120},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "securityContext": CONTAINER_SECURITY,
        "resources": limits,
        "volumeMounts": mounts,
    }


def _toleration(text: str) -> dict[str, str]:
    """``KEY[=VALUE]:EFFECT`` as a toleration (``Exists`` without a value, ``Equal`` with one)."""
    taint, _, effect = text.rpartition(":")
    key, equals, value = taint.partition("=")
    if equals:
        return {"key": key, "operator": "Equal", "value": value, "effect": effect}
    return {"key": key, "operator": "Exists", "effect": effect}


def failure_policy(container: str) -> dict[str, Any]:
    """The pod failure policy that reads the agent's exit codes in ``container`` (see the module docstring)."""
    leaves = sorted([left_on(signal.SIGTERM), left_on(signal.SIGINT)])  # the API wants them in order
    return {
        "rules": [
            {
                "action": "FailJob",  # the training job failed: so does this Job
                "onExitCodes": {"containerName": container, "operator": "In", "values": [int(ExitCode.JOB_FAILED)]},
            },
            {
                "action": "Ignore",  # left gracefully (deleted, drained, preempted): the index gets a new pod
                "onExitCodes": {"containerName": container, "operator": "In", "values": leaves},
            },
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def _agents(unit: JobUnit, claim: str) -> dict[str, Any]:
    """The agents: an elastic Indexed Job (see the module docstring)."""
    meta = _meta(unit, unit.name, "agent")
    command = list(unit.command)
    if unit.script is not None:
        command = [f"{SCRIPT_DIR}/{unit.script.name}", *command]
    service = names.coordinator_host(unit.control_plane_namespace)
    token_secret = unit.token_secret or names.JOIN_SECRET
    create = [] if unit.token_secret else ["--create-job"]  # a namespace's token: the first join creates the job
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
            f"--coordinator={service}:{names.API_PORT}",
            f"--bootstrap={service}:{names.BOOTSTRAP_PORT}",
            f"--ca-cert-hash={unit.ca_cert_hash}",
            f"--job={unit.control_plane_job_id}",
            *create,
            f"--nnodes={unit.min_nodes}:{unit.max_nodes}",
            f"--nproc-per-node={unit.nproc_per_node}",
            f"--max-restarts={unit.max_restarts}",
            f"--node-id={unit.namespace}.$(POD_NAME)",  # node ids are unique across the control plane's jobs
            "--host=$(POD_IP)",
            f"--metrics-port={names.METRICS_PORT}",
            f"--checkpoint-dir=/checkpoints/{unit.job_id}",
            f"--rescale-grace={unit.rescale_grace_s:g}",
            f"--stop-grace={unit.stop_grace_s:g}",
            *command,
        ],
        **agent_pod_parts(token_secret, resources(unit.cpu, unit.memory, unit.gpus), mounts),
    }
    scheduling: dict[str, Any] = {}
    if unit.node_selector:
        scheduling["nodeSelector"] = dict(item.split("=", 1) for item in unit.node_selector)
    if unit.tolerations:
        scheduling["tolerations"] = [_toleration(item) for item in unit.tolerations]
    pod = hardened(
        {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": unit.termination_grace_s,
            **scheduling,
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
            "podFailurePolicy": failure_policy("agent"),
            "template": {"metadata": {"labels": meta["labels"]}, "spec": pod},
        },
    }
