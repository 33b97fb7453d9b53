"""pliant on Kubernetes: what ``pliant k8s`` prints for ``kubectl apply -f -``.

The control plane (etcd, the coordinator replicas, monitoring) is installed once from the kustomize base in
``deploy/``; its Secrets come from :mod:`pliant.k8s.secrets` (``pliant k8s secrets``). Each training job is one small
unit rendered from its parameters by :mod:`pliant.k8s.job` (``pliant k8s job``): its agents as an elastic Indexed Job
that get their certificates by the bootstrap join, the Job that creates it, its join token, checkpoint volume,
NetworkPolicy and PodDisruptionBudget. Rendering is pure (no cluster is contacted); :mod:`pliant.k8s.cli` is the
command.
"""

from pliant.k8s.job import JobUnit, render_job
from pliant.k8s.secrets import ControlPlanePki, render_secrets

__all__ = ["ControlPlanePki", "JobUnit", "render_job", "render_secrets"]
