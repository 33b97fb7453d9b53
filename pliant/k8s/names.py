"""The names the control plane in ``deploy/`` and the rendered jobs share: its namespace, Services, ports, Secrets, and
the recommended labels every object carries (``app.kubernetes.io/*``). ``tests/unit/test_k8s.py`` checks that
``deploy/`` uses these.
"""

from __future__ import annotations

import re

from pliant import __version__

__all__ = [
    "AGENT",
    "API_PORT",
    "BOOTSTRAP_PORT",
    "CHECKPOINT_CLAIM",
    "COORDINATOR",
    "COORDINATOR_TLS",
    "ETCD_CLIENT_TLS",
    "ETCD_TLS",
    "JOIN_SECRET",
    "METRICS_PORT",
    "MIN_KUBERNETES",
    "NAMESPACE",
    "SIGNING_CA",
    "coordinator_host",
    "is_namespace",
    "labels",
    "selector",
]

MIN_KUBERNETES = "1.29.0"  # elastic Indexed Jobs and pod failure policies on by default, the schemas validated
NAMESPACE = "pliant"
COORDINATOR = "pliant-coordinator"  # the coordinators' Service (and app.kubernetes.io/name)
AGENT = "pliant-agent"  # every job's agents' app.kubernetes.io/name
API_PORT = 29400  # the coordinator API (mutual TLS)
BOOTSTRAP_PORT = 29402  # the bootstrap join (TLS that checks the server only)
METRICS_PORT = 9400  # an agent's metrics and /healthz

ETCD_TLS = "etcd-tls"  # etcd's serving and peer certificate, from the etcd CA
ETCD_CLIENT_TLS = "pliant-etcd-client-tls"  # the coordinators' etcd client certificate, from the etcd CA
COORDINATOR_TLS = "pliant-coordinator-tls"  # the coordinators' serving certificate, from the pliant CA
SIGNING_CA = "pliant-signing-ca"  # the pliant CA's certificate and key: the coordinators sign agents' requests
CHECKPOINT_CLAIM = "pliant-checkpoints"  # in a job namespace: where its TrainJobs keep their checkpoints
JOIN_SECRET = "pliant-join"  # in a job namespace: its join token (pliant k8s namespace), which creates its jobs

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def is_namespace(name: str) -> bool:
    """Whether ``name`` is a valid namespace name (a DNS label)."""
    return bool(_DNS_LABEL.fullmatch(name))


def coordinator_host(namespace: str) -> str:
    """The coordinators' Service as pods of any namespace reach it (a name their certificate carries)."""
    return f"{COORDINATOR}.{namespace}.svc"


def labels(name: str, instance: str, component: str, managed_by: str = "pliant") -> dict[str, str]:
    """The six recommended labels: ``name`` the application (what selectors use), ``instance`` this installation or
    job, ``component`` its role, ``managed_by`` what rendered it (``pliant`` for ``pliant k8s``, ``kustomize`` for
    ``deploy/``)."""
    return {
        "app.kubernetes.io/name": name,
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/version": __version__,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "pliant",
        "app.kubernetes.io/managed-by": managed_by,
    }


def selector(name: str, instance: str) -> dict[str, str]:
    """The labels that select ``instance``'s pods of ``name`` (never the version: an upgrade keeps its pods)."""
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/instance": instance}
