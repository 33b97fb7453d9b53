"""The control plane's certificates and the Secrets ``deploy/`` mounts, made in one step (``pliant k8s secrets``).

Two CAs, as etcd and pliant trust different parties: etcd's (its members' serving and peer certificate, and the
coordinators' etcd client certificate) and pliant's (the coordinators' serving certificate, an admin certificate, and
the CA's key itself, with which the coordinators sign each agent's own certificate at its bootstrap join, as
kube-controller-manager signs kubelets' with ``--cluster-signing-key-file``). Agents need no Secret of their own.
The admin certificate stays on the operator's machine (``DIR/admin``): no Secret carries it, and no pod in the cluster
acts as an admin. Every Secret printed here goes into the control plane's namespace; a job namespace gets only its join
token (:func:`join_secret`).

Everything is kept in one directory (keys 0600, the directory 0700) and made only where missing, so running the command
again prints the same Secrets; remove a subdirectory to issue that certificate again. The layout:

```
DIR/ca.crt, ca.key                 pliant's CA (agents pin ca.crt: ``pliant certs fingerprint --certs-dir DIR``)
DIR/coordinator/                   the coordinators' serving certificate
DIR/admin/                         an admin's (``pliant status --tls-dir DIR/admin``)
DIR/etcd/ca.crt, ca.key            etcd's CA
DIR/etcd/server/                   the etcd members' serving and peer certificate
DIR/etcd/client/                   the coordinators' etcd client certificate
```
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pliant.certs import CA_KEY, create_ca_files, load_ca
from pliant.k8s import names
from pliant.k8s.names import labels
from pliant.security.identity import Role
from pliant.security.issuance import IssuedCert, issue_cert, write_tls_dir
from pliant.security.tlsdir import CA_CERT, TLS_CERT, TLS_KEY

__all__ = ["ETCD_MEMBERS", "ControlPlanePki", "checkpoint_claim", "join_secret", "render_secrets"]

ETCD_MEMBERS = 3  # deploy/etcd.yaml's StatefulSet


@dataclass(frozen=True)
class ControlPlanePki:
    """The control plane's certificates under ``directory`` (see the module docstring)."""

    directory: Path

    @classmethod
    def ensure(
        cls, directory: str | Path, namespace: str = names.NAMESPACE, hosts: Sequence[str] = ()
    ) -> ControlPlanePki:
        """Make what is missing under ``directory``: both CAs, then each certificate, for the names ``deploy/``
        reaches its pods by in ``namespace`` plus ``hosts`` (more names or addresses, e.g. an ingress's).

        Raises:
            ConfigError: a CA's files are partly there (its key without its certificate, or the reverse).
        """
        pki = cls(Path(directory))
        pki.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        pliant_ca, etcd_ca = pki._ca(pki.directory, "pliant CA"), pki._ca(pki.directory / "etcd", "pliant etcd CA")
        members = [f"etcd-{i}.etcd" for i in range(ETCD_MEMBERS)]
        etcd_names = [*members, *(f"{m}.{namespace}.svc" for m in members), "etcd", f"etcd.{namespace}.svc", *hosts]
        coordinator_names = [
            names.COORDINATOR,
            f"{names.COORDINATOR}.{namespace}",
            f"{names.COORDINATOR}.{namespace}.svc",  # how job namespaces' agents reach it
            f"{names.COORDINATOR}.{namespace}.svc.cluster.local",
            "localhost",  # kubectl port-forward svc/pliant-coordinator 29400, then --coordinator localhost:29400
            "127.0.0.1",
            *hosts,
        ]
        pki._issue(etcd_ca, pki.directory / "etcd" / "server", Role.COORDINATOR, "etcd", etcd_names)
        pki._issue(etcd_ca, pki.directory / "etcd" / "client", Role.COORDINATOR, names.COORDINATOR)
        pki._issue(pliant_ca, pki.directory / "coordinator", Role.COORDINATOR, names.COORDINATOR, coordinator_names)
        pki._issue(pliant_ca, pki.directory / "admin", Role.ADMIN, "operator")
        return pki

    @staticmethod
    def _ca(directory: Path, common_name: str) -> IssuedCert:
        if not (directory / CA_CERT).exists() and not (directory / CA_KEY).exists():
            return create_ca_files(directory, common_name)
        return load_ca(str(directory))

    @staticmethod
    def _issue(ca: IssuedCert, directory: Path, role: Role, name: str, hosts: Sequence[str] = ()) -> None:
        if not (directory / TLS_CERT).exists():
            write_tls_dir(directory, ca.cert_pem, issue_cert(ca, role, name, list(hosts), 365))

    @property
    def ca_cert(self) -> Path:
        """pliant's CA certificate: what agents pin."""
        return self.directory / CA_CERT


def _secret(name: str, namespace: str, files: dict[str, Path]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name, "pliant", "pki", "pliant")},
        "type": "Opaque",
        "data": {key: base64.b64encode(path.read_bytes()).decode() for key, path in files.items()},
    }


def render_secrets(pki: ControlPlanePki, namespace: str = names.NAMESPACE) -> list[dict[str, Any]]:
    """The Secrets ``deploy/`` mounts, from ``pki``'s files."""

    def tls_dir(path: Path) -> dict[str, Path]:
        return {CA_CERT: path / CA_CERT, TLS_CERT: path / TLS_CERT, TLS_KEY: path / TLS_KEY}

    d = pki.directory
    return [
        _secret(names.ETCD_TLS, namespace, tls_dir(d / "etcd" / "server")),
        _secret(names.ETCD_CLIENT_TLS, namespace, tls_dir(d / "etcd" / "client")),
        _secret(names.COORDINATOR_TLS, namespace, tls_dir(d / "coordinator")),
        _secret(names.SIGNING_CA, namespace, {CA_CERT: d / CA_CERT, CA_KEY: d / CA_KEY}),
    ]


def join_secret(namespace: str, token: str) -> dict[str, Any]:
    """A job namespace's Secret ``pliant-join``: the namespace's join token, the one credential its agents hold (it
    creates and joins the namespace's jobs, nothing else)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": names.JOIN_SECRET,
            "namespace": namespace,
            "labels": labels(names.AGENT, namespace, "join-token", "pliant"),
        },
        "type": "Opaque",
        "stringData": {"token": token},
    }


def checkpoint_claim(namespace: str, size: str, storage_class: str = "") -> dict[str, Any]:
    """A job namespace's ReadWriteMany claim ``pliant-checkpoints``, where its TrainJobs keep their checkpoints (each
    under its own name; :mod:`pliant.k8s.trainer`)."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": names.CHECKPOINT_CLAIM,
            "namespace": namespace,
            "labels": labels(names.AGENT, namespace, "checkpoints", "pliant"),
        },
        "spec": spec,
    }
