"""pliant as a Kubeflow Trainer runtime: a ``ClusterTrainingRuntime`` whose TrainJobs train under pliant's agents
(rendered, pure: ``pliant k8s trainer-runtime``).

A platform team installs it once; its users keep writing the object they already write, a ``TrainJob`` in their
namespace, naming this runtime and giving the training script as ``trainer.args`` (``examples/k8s/trainjob.yaml``):

- **What runs.** The runtime's one replicated job, ``node`` (Trainer's torch policy injects its ``PET_*`` variables
  there), runs ``pliant agent`` as the container's command, and the TrainJob's ``args`` (the script and its arguments)
  after it; ``trainer.command`` would replace the agent, so a TrainJob gives none. Each pod is a node of the pliant
  job ``<namespace>.<trainjob>``, which the first agent's bootstrap join creates with the namespace's join token (the
  Secret ``pliant-join`` that ``pliant k8s namespace`` printed): no admin key, no per-job Secret, as with ``pliant k8s
  job``. Node ids are ``<namespace>.<pod>``; checkpoints go to ``<trainjob>/`` on the namespace's ReadWriteMany claim
  ``pliant-checkpoints`` (``pliant k8s namespace --checkpoint-size``).
- **Elastic within numNodes.** ``--nnodes 1:$(PET_NNODES)``: the job trains at whatever number of its pods are
  running, from one to ``trainer.numNodes``; a pod deleted, preempted or drained leaves gracefully, the Job controller
  starts its replacement and that node joins again (the pod failure policy reads the agent's exit codes as ``pliant
  k8s job``'s does). ``trainer.numProcPerNode`` is the workers per node (``PET_NPROC_PER_NODE``).
- **What Trainer's API does not allow** (its elastic KEP is open): a minimum node count other than 1 and a maximum
  other than ``numNodes``, resizing a running TrainJob (``numNodes`` is fixed while it runs: scaling is pods coming
  and going, not a patch), and a per-job NetworkPolicy (a runtime renders none: within a namespace, its pliant jobs'
  agents are not isolated from each other by the network).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pliant import settings
from pliant.agent.stopping import DUMP_S, KILL_REAP_S
from pliant.errors import ConfigError
from pliant.k8s import names
from pliant.k8s.job import LEAVE_SLACK_S, agent_pod_parts, failure_policy, hardened, resources
from pliant.k8s.names import labels

__all__ = ["TrainerRuntime", "render_trainer_runtime"]

TRAINER_API = "trainer.kubeflow.org/v1alpha1"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # on every pod of a TrainJob: its name
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_CA_HASH = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class TrainerRuntime:
    """The runtime's parameters (``pliant k8s trainer-runtime``'s flags).

    Attributes:
        image: the pliant image (deploy/Dockerfile) with the training code.
        ca_cert_hash: ``sha256:<hex>`` of the control plane's CA.
        name: the ClusterTrainingRuntime's name, which TrainJobs name in ``runtimeRef``.
        control_plane_namespace: where ``deploy/`` installed the control plane.
        shm_size: each pod's ``/dev/shm``.
        rescale_grace_s: the agents' ``--rescale-grace``.
        stop_grace_s: the agents' ``--stop-grace``.
        max_restarts: worker failures a TrainJob's pliant job survives.
    """

    image: str
    ca_cert_hash: str
    name: str = "pliant"
    control_plane_namespace: str = names.NAMESPACE
    shm_size: str = "1Gi"
    rescale_grace_s: float = settings.RESCALE_GRACE_S
    stop_grace_s: float = settings.STOP_GRACE_S
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if not self.image:
            raise ConfigError("--image is required: the pliant image with the training code (deploy/Dockerfile)")
        if not _CA_HASH.fullmatch(self.ca_cert_hash):
            raise ConfigError(
                f"--ca-cert-hash {self.ca_cert_hash!r} must be sha256:<64 hex digits>; pass --ca-cert pki/ca.crt"
            )
        if not _NAME.fullmatch(self.name) or not names.is_namespace(self.control_plane_namespace):
            raise ConfigError(
                f"--name {self.name!r} and --control-plane-namespace {self.control_plane_namespace!r} must be DNS "
                f"labels, e.g. pliant"
            )
        if self.rescale_grace_s <= 0 or self.stop_grace_s <= 0 or self.max_restarts < 0:
            raise ConfigError("--rescale-grace and --stop-grace must be > 0 seconds, --max-restarts >= 0")

    @property
    def termination_grace_s(self) -> int:
        return math.ceil(self.rescale_grace_s + DUMP_S + self.stop_grace_s + KILL_REAP_S + LEAVE_SLACK_S)


def _field(path: str) -> dict[str, Any]:
    return {"fieldRef": {"fieldPath": path}}


def render_trainer_runtime(runtime: TrainerRuntime) -> dict[str, Any]:
    """The ClusterTrainingRuntime (see the module docstring)."""
    service = names.coordinator_host(runtime.control_plane_namespace)
    pod_labels = {
        **labels(names.AGENT, runtime.name, "agent"),
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer",
    }
    container = {
        "name": "node",  # where Trainer's torch policy injects PET_NNODES and PET_NPROC_PER_NODE
        "image": runtime.image,
        "command": [
            "pliant",
            "agent",
            f"--coordinator={service}:{names.API_PORT}",
            f"--bootstrap={service}:{names.BOOTSTRAP_PORT}",
            f"--ca-cert-hash={runtime.ca_cert_hash}",
            "--job=$(POD_NAMESPACE).$(TRAINJOB_NAME)",
            "--create-job",
            "--nnodes=1:$(PET_NNODES)",
            "--nproc-per-node=$(PET_NPROC_PER_NODE)",
            f"--max-restarts={runtime.max_restarts}",
            "--node-id=$(POD_NAMESPACE).$(POD_NAME)",
            "--host=$(POD_IP)",
            f"--metrics-port={names.METRICS_PORT}",
            "--checkpoint-dir=/checkpoints/$(TRAINJOB_NAME)",
            f"--rescale-grace={runtime.rescale_grace_s:g}",
            f"--stop-grace={runtime.stop_grace_s:g}",
            "--",  # the TrainJob's trainer.args: the script and its arguments
        ],
        **agent_pod_parts(
            names.JOIN_SECRET,
            resources("2", "8Gi"),  # TrainJob's resourcesPerNode replaces these
            [
                {"name": "checkpoints", "mountPath": "/checkpoints"},
                {"name": "shm", "mountPath": "/dev/shm"},
                {"name": "tmp", "mountPath": "/tmp"},
            ],
            env=(
                {"name": "POD_NAMESPACE", "valueFrom": _field("metadata.namespace")},
                {"name": "TRAINJOB_NAME", "valueFrom": _field(f"metadata.labels['{JOBSET_NAME_LABEL}']")},
            ),
        ),
    }
    pod = hardened(
        {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": runtime.termination_grace_s,
            "containers": [container],
            "volumes": [
                {"name": "checkpoints", "persistentVolumeClaim": {"claimName": names.CHECKPOINT_CLAIM}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": runtime.shm_size}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
            ],
        }
    )
    return {
        "apiVersion": TRAINER_API,
        "kind": "ClusterTrainingRuntime",
        "metadata": {
            "name": runtime.name,
            "labels": {
                **labels(names.AGENT, runtime.name, "trainer-runtime"),
                "trainer.kubeflow.org/framework": "torch",
            },
        },
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                                "spec": {
                                    "backoffLimit": 6,
                                    "podFailurePolicy": failure_policy("node"),
                                    "template": {"metadata": {"labels": pod_labels}, "spec": pod},
                                },
                            },
                        }
                    ]
                }
            },
        },
    }
