"""Revoked certificates: a denylist of serials in etcd, which every replica checks on every call.

An admin revokes a certificate with ``RevokeCertificate`` (``pliant certs revoke``); the coordinator revokes an agent
certificate itself when it signs the node id another one: at once for a bootstrap join (the node id's earlier agent is
gone, or its key was taken), and :data:`RENEWAL_OVERLAP_S` after a renewal (the agent switches to its new certificate
at once; calls already under way finish). A revoked certificate is refused with UNAUTHENTICATED, naming its serial.

Each replica holds the list in memory (:class:`Denylist`): read whole at start, and again whenever a key under
``revoked/`` changes (an etcd watch, re-armed with backoff) and at least every :data:`RELOAD_S`. A replica that
revokes a certificate refuses it at once; the others within the watch's delay.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pliant.coordinator.contract import InvalidArgument, Revocation
from pliant.coordinator.etcd_watch import PrefixWatch
from pliant.coordinator.store import EtcdStore

__all__ = ["RELOAD_S", "RENEWAL_OVERLAP_S", "Denylist", "replaced_certificate", "revocation_of"]

logger = logging.getLogger(__name__)

RELOAD_S = 30.0  # the list is read again at least this often, whatever the watch saw
RENEWAL_OVERLAP_S = 60.0  # a renewed agent certificate stays valid this long after its successor was signed


class Denylist:
    """The revoked serials this replica refuses.

    Threads: ``_revoked`` is replaced whole (under ``_lock``) by the reload thread and by :meth:`revoke` on a call's
    thread; call threads read it in :meth:`why`.

    Args:
        store: the etcd store.
        clock: wall-clock seconds (a revocation takes effect at its ``effective_at``).
    """

    def __init__(self, store: EtcdStore, clock: Callable[[], float] = time.time) -> None:
        self._store, self._clock = store, clock
        self._revoked: dict[int, Revocation] = {}
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._watch = PrefixWatch(store, store.revoked_prefix, self._changed.set)
        self._thread = threading.Thread(target=self._run, name="denylist", daemon=True)

    def start(self) -> Denylist:
        self._reload()
        self._watch.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        self._watch.stop()
        self._thread.join(5)

    def why(self, serial: int) -> str:
        """Why certificate ``serial`` is refused ("" when it is not)."""
        record = self._revoked.get(serial)
        if record is None or self._clock() < record.effective_at:
            return ""
        return record.reason or "revoked"

    def revoke(self, record: Revocation) -> None:
        """Write ``record`` to etcd and refuse its certificate here at once."""
        self._store.revoke(record, self._clock())
        with self._lock:
            self._revoked = {**self._revoked, record.serial: record}

    def _run(self) -> None:
        while not self._stop.is_set():
            self._changed.wait(RELOAD_S)
            if self._stop.is_set():
                return
            self._changed.clear()
            self._reload()

    def _reload(self) -> None:
        try:
            revoked = self._store.revoked()
        except Exception as exc:  # etcd away: keep the list held (revocations never lapse here by an outage)
            logger.warning(
                "denylist not reloaded (%s: %s); keeping %d revocations", type(exc).__name__, exc, len(self._revoked)
            )
            return
        with self._lock:
            self._revoked = revoked


def revocation_of(cert_pem: bytes, serial: str, reason: str, by: str, now: float) -> Revocation:
    """The record that revokes the certificate ``cert_pem`` (or, without it, the one of serial ``serial``, hex).

    Raises:
        InvalidArgument: neither is given, or the one given does not parse.
    """
    why = f"revoked by {by}" + (f": {reason[:200]}" if reason else "")
    if cert_pem:
        from cryptography import x509

        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
        except ValueError as exc:
            raise InvalidArgument(f"cert_pem is not a PEM certificate ({exc}); pass the tls.crt to revoke") from None
        return Revocation(
            cert.serial_number, cert.subject.rfc4514_string(), why, now, now, cert.not_valid_after_utc.timestamp()
        )
    try:
        number = int(serial.removeprefix("0x"), 16)
    except ValueError:
        number = 0
    if number <= 0:
        raise InvalidArgument(
            f"serial {serial[:100]!r} is not a certificate serial in hex; pass the certificate "
            f"(--cert tls.crt) or its serial (openssl x509 -noout -serial)"
        )
    return Revocation(number, "", why, now, now)


def replaced_certificate(
    store: EtcdStore,
    denylist: Denylist | None,
    job: str,
    node: str,
    cert_pem: bytes,
    how: str,
    overlap_s: float,
    now: float,
) -> None:
    """Node id ``node`` of job ``job`` was signed ``cert_pem`` (``how``: "renewed", "signed again"): record it, and
    revoke the agent certificate the node id held before in that job, ``overlap_s`` from ``now`` (one node id, one
    certificate, one job).

    Raises:
        AlreadyExists: the node id holds a certificate of another job that has not expired (nothing was recorded).
    """
    from pliant.security.identity import certificate_serial, not_after

    old = store.replace_agent_cert(job, node, certificate_serial(cert_pem), not_after(cert_pem).timestamp(), now)
    if old is None or denylist is None or old[0] == certificate_serial(cert_pem):
        return
    denylist.revoke(
        Revocation(
            old[0], f"agent {node}", f"replaced: node {node}'s certificate was {how}", now, now + overlap_s, old[1]
        )
    )
