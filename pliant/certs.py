"""``pliant certs``: a CA and the certificates of coordinators, agents and admins, without a PKI team.

The commands follow CockroachDB's ``cockroach cert``::

    pliant certs create-ca --certs-dir certs                       # certs/ca.crt, certs/ca.key (keep the key safe)
    pliant certs create-coordinator coord.example.com 10.0.0.5 --certs-dir certs   # -> certs/coordinator-<name>/
    pliant certs create-agent node-7 --certs-dir certs             # -> certs/agent-node-7/
    pliant certs create-admin alice --certs-dir certs              # -> certs/admin-alice/
    pliant certs list --certs-dir certs
    pliant certs fingerprint --certs-dir certs                     # sha256:... : the --ca-cert-hash nodes pin
    pliant certs revoke certs/agent-node-7/tls.crt --coordinator HOST:PORT --tls-dir certs/admin-alice

Each issued certificate lands in its own directory holding ``ca.crt``, ``tls.crt`` and ``tls.key``: the layout that
``--tls-dir`` reads (and a Kubernetes TLS Secret mounts).
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

from pliant.errors import ConfigError
from pliant.flags import add_tls_flags, tls_from_flags
from pliant.security.identity import Role, ca_fingerprint
from pliant.security.issuance import IssuedCert, issue_cert, new_ca, write_tls_dir
from pliant.security.tlsdir import CA_CERT, TLS_CERT

__all__ = ["CA_KEY", "add_certs_commands", "certs_main", "create_ca_files", "load_ca"]

CA_KEY = "ca.key"


def add_certs_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``pliant certs ...`` to the top-level subcommands."""
    certs = sub.add_parser(
        "certs",
        help="create a CA and issue coordinator, agent and admin certificates",
        description="Create a CA and issue certificates for mutual TLS. Each issued certificate goes to its own "
        "directory (ca.crt, tls.crt, tls.key): pass that directory as --tls-dir.",
    )
    actions = certs.add_subparsers(dest="certs_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser, issue: bool = True) -> None:
        p.add_argument("--certs-dir", required=True, help="directory of the CA (ca.crt, ca.key)")
        if issue:
            p.add_argument("--ca-key", default=None, help="the CA's private key (default CERTS_DIR/ca.key)")
            p.add_argument("--out", default=None, help="directory to write into (default CERTS_DIR/ROLE-NAME)")
            p.add_argument("--lifetime-days", type=float, default=365, help="validity in days (default 365)")
            p.add_argument("--overwrite", action="store_true", help="replace existing files")

    ca = actions.add_parser("create-ca", help="create the CA certificate and key")
    ca.add_argument("--certs-dir", required=True, help="directory to write ca.crt and ca.key into")
    ca.add_argument("--lifetime-days", type=float, default=3650, help="validity in days (default 3650)")
    ca.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing CA (every certificate it issued stops being trusted)",
    )
    coord = actions.add_parser("create-coordinator", help="issue a coordinator (server) certificate")
    coord.add_argument("hosts", nargs="+", help="DNS names and IP addresses clients reach the coordinator by")
    coord.add_argument("--name", default="coordinator", help="the certificate's name (default coordinator)")
    common(coord)
    agent = actions.add_parser("create-agent", help="issue an agent certificate for one node id")
    agent.add_argument("node_id", help="the node id the agent runs as (its --node-id)")
    common(agent)
    admin = actions.add_parser("create-admin", help="issue an admin (client) certificate")
    admin.add_argument("name", nargs="?", default="admin", help="who holds it (default admin)")
    common(admin)
    fingerprint = actions.add_parser(
        "fingerprint", help="print the CA's fingerprint, the --ca-cert-hash that nodes pin for a bootstrap join"
    )
    fingerprint.add_argument("--certs-dir", required=True, help="directory of the CA (ca.crt)")
    listing = actions.add_parser("list", help="list the certificates under a directory")
    common(listing, issue=False)
    revoke = actions.add_parser(
        "revoke",
        help="refuse a certificate from now on, on every coordinator replica (a lost node's, a departed admin's)",
    )
    revoke.add_argument("cert", nargs="?", default=None, help="the certificate file to revoke (its tls.crt)")
    revoke.add_argument("--serial", default="", help="its serial number in hex, when the file is gone")
    revoke.add_argument("--reason", default="", help="why (kept with the revocation, and in the refusals)")
    revoke.add_argument("--coordinator", required=True, help="HOST:PORT[,...] of the coordinator replicas")
    add_tls_flags(revoke, "admin")
    certs.set_defaults(func=lambda args: certs_main(args))


def load_ca(certs_dir: str, ca_key: str | None = None) -> IssuedCert:
    """Read the CA of ``certs_dir``.

    Raises:
        ConfigError: the files are missing; the message says how to create them.
    """
    cert_path = Path(certs_dir) / CA_CERT
    key_path = Path(ca_key) if ca_key else Path(certs_dir) / CA_KEY
    for path in (cert_path, key_path):
        if not path.is_file():
            raise ConfigError(f"{path} not found; create the CA first: pliant certs create-ca --certs-dir {certs_dir}")
    return IssuedCert(cert_path.read_bytes(), key_path.read_bytes())


def _refuse_overwrite(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} already exists; pass --overwrite to replace it, or choose another --out")


def create_ca_files(
    directory: str | os.PathLike[str], common_name: str = "pliant CA", lifetime_days: float = 3650
) -> IssuedCert:
    """Make a CA and write ``ca.crt`` and ``ca.key`` (mode 0600) into ``directory`` (created 0700), replacing any."""
    path = Path(directory)
    ca = new_ca(common_name, lifetime_days)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    (path / CA_CERT).write_bytes(ca.cert_pem)
    fd = os.open(path / CA_KEY, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an overwritten key gets this mode, whatever the old file had
    with os.fdopen(fd, "wb") as out:
        out.write(ca.key_pem)
    return ca


def _create_ca(args: argparse.Namespace) -> str:
    path = Path(args.certs_dir)
    _refuse_overwrite(path / CA_KEY, args.overwrite)
    create_ca_files(path, lifetime_days=args.lifetime_days)
    return f"CA written to {path / CA_CERT} and {path / CA_KEY} (keep the key offline; only ca.crt is distributed)"


def _issue(args: argparse.Namespace, role: Role, name: str, hosts: list[str]) -> str:
    if args.lifetime_days <= 0:
        raise ConfigError(f"--lifetime-days {args.lifetime_days:g} must be > 0")
    ca = load_ca(args.certs_dir, args.ca_key)
    out = Path(args.out) if args.out else Path(args.certs_dir) / f"{role.value}-{name}"
    _refuse_overwrite(out / TLS_CERT, args.overwrite)
    write_tls_dir(out, ca.cert_pem, issue_cert(ca, role, name, hosts, args.lifetime_days))
    return f"{role.value} certificate for {name!r} written to {out}/ (pass --tls-dir {out})"


def _list(args: argparse.Namespace) -> str:
    from cryptography import x509

    from pliant.security.identity import identity_from_pem

    rows = []
    for cert_path in sorted(Path(args.certs_dir).rglob("*.crt")):
        if cert_path.name == CA_CERT and cert_path.parent != Path(args.certs_dir):
            continue
        pem = cert_path.read_bytes()
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError:
            rows.append(f"{cert_path}: not a PEM certificate")
            continue
        ident = identity_from_pem(pem)
        what = str(ident) if ident else ("CA" if cert_path.name == CA_CERT else cert.subject.rfc4514_string())
        left = cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
        state = f"expires {cert.not_valid_after_utc:%Y-%m-%d}" if left.total_seconds() > 0 else "EXPIRED"
        rows.append(f"{cert_path}: {what}, {state}")
    return "\n".join(rows) or f"no certificates under {args.certs_dir}"


def certs_main(args: argparse.Namespace) -> int:
    """Run one ``pliant certs`` action and print what it wrote."""
    action = args.certs_command
    if action == "create-ca":
        message = _create_ca(args)
    elif action == "create-coordinator":
        message = _issue(args, Role.COORDINATOR, args.name, args.hosts)
    elif action == "create-agent":
        message = _issue(args, Role.AGENT, args.node_id, [])
    elif action == "create-admin":
        message = _issue(args, Role.ADMIN, args.name, [])
    elif action == "fingerprint":
        path = Path(args.certs_dir) / CA_CERT
        if not path.is_file():
            raise ConfigError(f"{path} not found; create the CA: pliant certs create-ca --certs-dir {args.certs_dir}")
        message = ca_fingerprint(path.read_bytes())
    elif action == "revoke":
        message = _revoke(args)
    else:
        message = _list(args)
    print(message, flush=True)
    return 0


def _revoke(args: argparse.Namespace) -> str:
    from pliant.coordinator.client import CoordinatorClient

    if bool(args.cert) == bool(args.serial):
        raise ConfigError("name the certificate to revoke: its file (pliant certs revoke PATH/tls.crt) or --serial HEX")
    pem = b""
    if args.cert:
        try:
            pem = Path(args.cert).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {args.cert}: {exc.strerror}; pass the certificate's tls.crt") from None
    tls = tls_from_flags(args.tls_dir, args.insecure, "certs revoke")
    client = CoordinatorClient(args.coordinator, tls.load() if tls else None, retry_for_s=5.0)
    try:
        serial, subject = client.revoke_certificate(pem, args.serial, args.reason)
    finally:
        client.close()
    return f"revoked certificate serial {serial}{f' ({subject})' if subject else ''}: every replica refuses it"
