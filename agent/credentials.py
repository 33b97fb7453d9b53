"""The agent's certificate when it joined by bootstrap: getting it (:mod:`pliant.bootstrap`) and renewing it over
mutual TLS before it expires. A certificate made beforehand (``--tls-dir``) is not touched here."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pliant.agent.contract import AgentConfig
from pliant.bootstrap import BootstrapError, CertificateLifetime, renewal_due, request_certificate
from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import CoordinatorError, JobFinished
from pliant.coordinator.convert import spec_to_pb
from pliant.security.tlsdir import TlsMaterial

__all__ = ["Credentials"]

logger = logging.getLogger(__name__)


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


class Credentials:
    """A bootstrap-issued agent certificate and its renewal.

    :meth:`bootstrap` runs on the agent's main thread before the join; from then on :meth:`renew_if_due` runs on the
    heartbeat thread only, which owns ``lifetime`` and ``failing``.

    Args:
        config: the agent's configuration (its pin, bootstrap addresses, job and node id).
        client: the agent's coordinator client; it presents each new certificate from then on.
        stop: set when the agent stops (ends the waits).
    """

    def __init__(self, config: AgentConfig, client: CoordinatorClient, stop: threading.Event) -> None:
        self.config = config
        self.client = client
        self.stop = stop
        self.lifetime: CertificateLifetime | None = None
        self.failing = False

    def bootstrap(self, token: str, waiting: Callable[[str, str], None] | None = None) -> TlsMaterial:
        """Get this node's agent certificate by the bootstrap join: pin the CA, make a key, have it signed for the
        join token. Retried while no bootstrap service answers (up to the config's ``heartbeat_retry_s``) and while
        an earlier agent of this node id still holds its membership (as long as the join waits for it); ``waiting``
        is told at each retry what it waits for and why.

        Raises:
            JobFinished: the job has finished.
            BootstrapError: a refusal (its message says which and what to do), or nothing answered.
        """
        config = self.config
        deadline = time.monotonic() + config.heartbeat_retry_s
        held_until = time.monotonic() + config.held_membership_wait_s
        attempt = 0
        while True:
            address = config.bootstrap[attempt % len(config.bootstrap)]
            attempt += 1
            try:
                tls = request_certificate(
                    address,
                    config.ca_cert_hash,
                    config.spec.job_id,
                    config.node_id,
                    token,
                    create=spec_to_pb(config.spec) if config.create_job else None,
                )
                break
            except BootstrapError as exc:
                now = time.monotonic()
                if exc.code == "UNAVAILABLE" and now < deadline:
                    if waiting is not None:
                        why = str(exc).rsplit(": ", 1)[-1][:120]
                        limit = f"gives up after {config.heartbeat_retry_s:g}s"
                        waiting(f"waiting for the bootstrap service at {','.join(config.bootstrap)}", f"{why}; {limit}")
                    self.stop.wait(min(1.0, 0.1 * attempt))
                    continue
                if exc.code == "ALREADY_EXISTS" and now < held_until:
                    if waiting is not None:
                        waiting(f"waiting for an earlier agent of node {config.node_id} to be dropped", "")
                    if attempt == 1:
                        logger.info(
                            "agent %s: an earlier agent of this node id still holds its membership; waiting for it "
                            "to be dropped",
                            config.node_id,
                        )
                    self.stop.wait(0.5)
                    continue
                finished = JobFinished.parse(str(exc)) if exc.code == "FAILED_PRECONDITION" else None
                if finished is not None:
                    raise finished from exc
                raise
        self.client.use_tls(tls)
        self.lifetime = CertificateLifetime.of(tls.cert_pem, time.time())
        logger.info(
            "agent %s: certificate signed at %s by the pinned CA (%s...), valid until %s",
            config.node_id,
            address,
            config.ca_cert_hash[:19],
            _utc(self.lifetime.not_after),
        )
        return tls

    def renew_if_due(self) -> TlsMaterial | None:
        """Renew the certificate over mutual TLS once two thirds of its life have passed; returns the new material
        (None: not due, not bootstrap-issued, or the renewal failed, which is said once and retried next time)."""
        if self.lifetime is None or not renewal_due(self.lifetime, time.time()):
            return None
        try:
            fresh, expiry = self.client.renew_certificate(self.config.spec.job_id)
        except CoordinatorError as exc:
            if not self.failing:
                logger.warning(
                    "agent %s: certificate renewal failed (%s); retrying, it expires at %s",
                    self.config.node_id,
                    exc,
                    _utc(self.lifetime.not_after),
                )
            self.failing = True
            return None
        self.failing = False
        self.lifetime = CertificateLifetime(time.time(), expiry)
        logger.info("agent %s: certificate renewed, valid until %s", self.config.node_id, _utc(expiry))
        return fresh
