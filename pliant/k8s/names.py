"""The names the control plane in ``deploy/`` and the rendered jobs share: its namespace, Services, ports, Secrets, and
the recommended labels every object carries (``app.kubernetes.io/*``). ``tests/unit/test_k8s.py`` checks that
``deploy/`` uses these.
"""

from __future__ import annotations

from pliant import __version__

__all__ = [
    "ADMIN",
    "ADMIN_TLS",
    "AGENT",
    "API_PORT",
    "BOOTSTRAP_PORT",
    "COORDINATOR",
    "COORDINATOR_TLS",
    "ETCD_CLIENT_TLS",
    "ETCD_TLS",
    "METRICS_PORT",
    "NAMESPACE",
    "SIGNING_CA",
    "labels",
    "selector",
]

NAMESPACE = "pliant"
COORDINATOR = "pliant-coordinator"  # the coordinators' Service (and app.kubernetes.io/name)
AGENT = "pliant-agent"  # every job's agents' app.kubernetes.io/name
ADMIN = "pliant-admin"  # pods that act as an admin (the Jobs that create training jobs)
API_PORT = 29400  # the coordinator API (mutual TLS)
BOOTSTRAP_PORT = 29402  # the bootstrap join (TLS that checks the server only)
METRICS_PORT = 9400  # an agent's metrics and /healthz

ETCD_TLS = "etcd-tls"  # etcd's serving and peer certificate, from the etcd CA
ETCD_CLIENT_TLS = "pliant-etcd-client-tls"  # the coordinators' etcd client certificate, from the etcd CA
COORDINATOR_TLS = "pliant-coordinator-tls"  # the coordinators' serving certificate, from the pliant CA
ADMIN_TLS = "pliant-admin-tls"  # an admin certificate, for the Jobs that create training jobs
SIGNING_CA = "pliant-signing-ca"  # the pliant CA's certificate and key: the coordinators sign agents' requests


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
