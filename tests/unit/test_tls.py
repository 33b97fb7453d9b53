"""Certificates and TLS files: `pliant certs` issues what --tls-dir reads; bad files get errors naming the file and
the fix; the authorization rules are pure functions of the caller's certificate."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pliant.cli import main
from pliant.coordinator.authz import Caller, require_admin, require_node
from pliant.coordinator.contract import (
    InvalidArgument,
    PermissionDenied,
    truncate_reason,
    validate_address,
    validate_id,
)
from pliant.errors import ConfigError
from pliant.flags import tls_from_flags
from pliant.security.identity import Identity, Role
from pliant.security.issuance import LocalCA
from pliant.security.tlsdir import TlsConfig
from pliant.security.tokens import read_token_file


def test_pliant_certs_creates_a_ca_and_every_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    certs = str(tmp_path / "certs")
    assert main(["certs", "create-ca", "--certs-dir", certs]) == 0
    assert oct(os.stat(Path(certs) / "ca.key").st_mode & 0o777) == "0o600"
    assert main(["certs", "create-coordinator", "coord.example.com", "10.0.0.5", "--certs-dir", certs]) == 0
    assert main(["certs", "create-agent", "node-7", "--certs-dir", certs]) == 0
    assert main(["certs", "create-admin", "alice", "--certs-dir", certs]) == 0
    for sub, role, name in [
        ("coordinator-coordinator", Role.COORDINATOR, "coordinator"),
        ("agent-node-7", Role.AGENT, "node-7"),
        ("admin-alice", Role.ADMIN, "alice"),
    ]:
        material = TlsConfig.from_dir(Path(certs) / sub).load(expect=role)
        assert material.identity == Identity(role, name)
        assert oct(os.stat(Path(certs) / sub / "tls.key").st_mode & 0o777) == "0o600"
    capsys.readouterr()
    assert main(["certs", "list", "--certs-dir", certs]) == 0
    listing = capsys.readouterr().out
    assert "agent 'node-7', expires" in listing and "admin 'alice'" in listing
    # Issuing again without --overwrite is refused, naming the file.
    assert main(["certs", "create-agent", "node-7", "--certs-dir", certs]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["certs", "create-agent", "n", "--certs-dir", str(tmp_path / "nothing")]) == 2
    assert "create the CA first: pliant certs create-ca" in capsys.readouterr().err


def test_bad_tls_files_are_named_with_the_fix(tmp_path: Path) -> None:
    ca = LocalCA(tmp_path / "ca")
    good = Path(ca.issue("agent", Role.AGENT, "a").cert).parent
    with pytest.raises(ConfigError, match="is not a directory; create one with `pliant certs`"):
        TlsConfig.from_dir(tmp_path / "missing")
    with pytest.raises(ConfigError, match="needs an admin certificate"):
        TlsConfig.from_dir(good).load(expect=Role.ADMIN)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (broken / name).write_bytes((good / name).read_bytes())
    (broken / "tls.key").write_text("")
    with pytest.raises(ConfigError, match=r"private key .*tls.key is empty"):
        TlsConfig.from_dir(broken).load()
    (broken / "tls.key").write_text("not a key")
    with pytest.raises(ConfigError, match=r"tls.key is not an unencrypted PEM private key"):
        TlsConfig.from_dir(broken).load()
    (broken / "tls.key").write_bytes((Path(ca.issue("other", Role.AGENT, "b").key)).read_bytes())
    with pytest.raises(ConfigError, match="does not belong to certificate"):
        TlsConfig.from_dir(broken).load()
    (broken / "tls.key").write_bytes((good / "tls.key").read_bytes())
    (broken / "ca.crt").write_bytes(LocalCA(tmp_path / "other").ca.cert_pem)
    with pytest.raises(ConfigError, match="was not issued by the CA"):
        TlsConfig.from_dir(broken).load()
    (broken / "tls.crt").write_text("-----BEGIN CERTIFICATE-----\nxx\n-----END CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match=r"tls\.crt is not a PEM certificate"):
        TlsConfig.from_dir(broken).load()


def test_tls_or_insecure_is_an_explicit_choice(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TLS is required for `pliant agent`: pass --tls-dir DIR"):
        tls_from_flags(None, False, "agent")
    with pytest.raises(ConfigError, match="contradict each other"):
        tls_from_flags(str(tmp_path), True, "agent")
    assert tls_from_flags(None, True, "agent") is None


def test_token_files(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty; write the job's token"):
        read_token_file(str(empty))
    with pytest.raises(ConfigError, match="cannot be read"):
        read_token_file(str(tmp_path / "none"))
    empty.write_text("  secret-token-value  \n")
    assert read_token_file(str(empty)) == "secret-token-value"


def test_authorization_rules() -> None:
    admin, plain = Caller(Identity(Role.ADMIN, "root")), Caller(None)
    agent, coordinator = Caller(Identity(Role.AGENT, "a")), Caller(Identity(Role.COORDINATOR, "c"))
    for caller in (admin, plain):
        require_admin(caller, "FinishJob")
        require_node(caller, "anyone", "Heartbeat", "j")
    require_node(agent, "a", "Heartbeat", "any-job")
    with pytest.raises(PermissionDenied, match="acts only for node 'a'"):
        require_node(agent, "b", "Heartbeat", "j")
    with pytest.raises(PermissionDenied, match="FinishJob needs an admin certificate"):
        require_admin(agent, "FinishJob")
    with pytest.raises(PermissionDenied, match="is for agents"):
        require_node(coordinator, "c", "Join", "j")
    bound = Caller(Identity(Role.AGENT, "a", job="j1"))  # a bootstrap-signed certificate names its job
    require_node(bound, "a", "Heartbeat", "j1")
    with pytest.raises(PermissionDenied, match="agent 'a' of job 'j1' acts only in its own job"):
        require_node(bound, "a", "Heartbeat", "j2")


def test_a_signed_agent_certificate_names_its_job_and_one_job_only(tmp_path) -> None:
    from pliant.security.identity import identity_from_pem
    from pliant.security.issuance import new_csr, sign_csr

    ca = LocalCA(tmp_path)
    _key, csr = new_csr(Role.AGENT, "n1")
    cert = sign_csr(ca.ca, csr, Role.AGENT, "n1", 60.0, job="j1")
    assert identity_from_pem(cert) == Identity(Role.AGENT, "n1", "j1")
    assert identity_from_pem(sign_csr(ca.ca, csr, Role.AGENT, "n1", 60.0)) == Identity(Role.AGENT, "n1")


def test_validators_bound_every_input() -> None:
    with pytest.raises(InvalidArgument, match=r"job_id 'abc\\n' is invalid"):
        validate_id("abc\n", "job_id")
    for good in ("10.0.0.5:29500", "node-3.pool.svc:1", "[::1]:80", "localhost:65535"):
        assert validate_address(good) == good
    for bad in ("evil host\n:80", "h:0", "h:65536", ":80", "h", "a..b:1", "1.2.3.4.5:1", "x" * 300 + ":1"):
        with pytest.raises(InvalidArgument) as info:
            validate_address(bad)
        assert len(str(info.value)) < 400
    cut = truncate_reason("é" * 5000)
    assert len(cut.encode()) <= 4096 and cut.endswith("[truncated: 10000 bytes, kept 4096]")
    assert truncate_reason("short") == "short"
