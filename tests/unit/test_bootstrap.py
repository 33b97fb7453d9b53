"""The bootstrap join's pure parts: the pin's format, the bootstrap port convention, when to renew, and what a
signer will sign."""

from __future__ import annotations

import pytest

from pliant.bootstrap import CertificateLifetime, bootstrap_address, parse_pin, renewal_due
from pliant.errors import ConfigError
from pliant.security.identity import Identity, Role, ca_fingerprint
from pliant.security.issuance import csr_identity, new_ca, new_csr, sign_csr


def test_a_pin_is_sha256_and_64_hex_digits() -> None:
    pin = ca_fingerprint(new_ca().cert_pem)
    assert parse_pin(pin) == pin and parse_pin(" " + pin.upper().replace("SHA", "sha") + "\n") == pin
    for bad in ("", "sha256:abc", "md5:" + "0" * 64, pin[7:], pin + "0"):
        with pytest.raises(ConfigError, match="--ca-cert-hash"):
            parse_pin(bad)


def test_the_bootstrap_port_is_the_api_port_plus_one() -> None:
    assert bootstrap_address("10.0.0.1:29400") == "10.0.0.1:29401"
    assert bootstrap_address("[fd00::1]:29400") == "[fd00::1]:29401"


def test_a_certificate_is_renewed_at_two_thirds_of_its_remaining_life() -> None:
    lifetime = CertificateLifetime(received_at=1000.0, not_after=1300.0)
    assert not renewal_due(lifetime, 1199.0) and renewal_due(lifetime, 1200.0)


def test_a_signer_signs_exactly_the_role_and_name_asked_for() -> None:
    ca = new_ca()
    _key, csr = new_csr(Role.AGENT, "node-1")
    assert csr_identity(csr) == Identity(Role.AGENT, "node-1")
    assert b"BEGIN CERTIFICATE" in sign_csr(ca, csr, Role.AGENT, "node-1", 60)
    with pytest.raises(ValueError, match="only the agent 'node-2' is signed"):
        sign_csr(ca, csr, Role.AGENT, "node-2", 60)
    _key, admin = new_csr(Role.ADMIN, "node-1")
    with pytest.raises(ValueError, match="asks for admin 'node-1'"):
        sign_csr(ca, admin, Role.AGENT, "node-1", 60)
    with pytest.raises(ValueError, match="not a PEM PKCS#10 request"):
        csr_identity(b"junk")
