"""etcd's runtime reconfiguration as the embedded control plane uses it, on real etcd members over mutual TLS: grow
one member to three through learners, lose one, remove it, and take its seat with a new member."""

from __future__ import annotations

import pytest

from pliant.coordinator.etcd_cluster import EtcdClusterError, EtcdMember, EtcdMembers, NotInSync, initial_cluster
from pliant.coordinator.etcd_server import EtcdServer, etcd_pki
from tests.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _add(members: EtcdMembers, name: str, peer_url: str) -> list[EtcdMember] | None:
    """Add a learner, or None while etcd refuses it as unsafe: a member promoted less than 5 s ago (etcd's health
    interval) does not count as healthy yet."""
    try:
        return members.add_learner(name, peer_url)
    except EtcdClusterError as exc:
        if "unhealthy cluster" not in str(exc):
            raise
        return None


def _join(members: EtcdMembers, name: str, server_tls, tmp_path, servers: list[EtcdServer]) -> None:  # type: ignore[no-untyped-def]
    """Add ``name`` as a learner, start its etcd into the cluster (into ``servers``), and promote it once it is in
    sync."""
    joining = EtcdServer(
        data_dir=str(tmp_path / name),
        tls=server_tls,
        name=name,
        cluster_state="existing",
        log_path=str(tmp_path / f"{name}.log"),
    )
    listed = wait_for(lambda: _add(members, name, joining.peer_url), 30, f"{name} added")
    assert [m.learner for m in listed if joining.peer_url in m.peer_urls] == [True]
    joining.initial_cluster = initial_cluster(listed, name, joining.peer_url)
    servers.append(joining)
    joining.start()

    def promoted() -> bool:
        learner = next(m for m in members.list() if joining.peer_url in m.peer_urls)
        try:
            members.promote(learner.id)
        except NotInSync:
            return False
        return True

    wait_for(promoted, 30, f"{name} promoted")


def test_a_cluster_grows_through_learners_and_a_lost_member_is_replaced(tmp_path) -> None:
    server_tls, client_tls = etcd_pki(tmp_path / "pki")
    servers = [EtcdServer(data_dir=str(tmp_path / "a"), tls=server_tls, name="a").start()]
    try:
        members = EtcdMembers([servers[0].endpoint], client_tls)
        _join(members, "b", server_tls, tmp_path, servers)
        members = EtcdMembers([s.endpoint for s in servers], client_tls)
        _join(members, "c", server_tls, tmp_path, servers)
        listed = members.list()
        assert sorted(m.name for m in listed) == ["a", "b", "c"] and not [m for m in listed if m.learner]

        servers[0].kill()  # a's node is gone: two of three members keep the quorum
        members = EtcdMembers([s.endpoint for s in servers[1:]], client_tls)
        gone = next(m for m in members.list() if m.name == "a")
        members.remove(gone.id)
        assert sorted(m.name for m in members.list()) == ["b", "c"]
        _join(members, "d", server_tls, tmp_path, servers)
        listed = members.list()
        assert sorted(m.name for m in listed) == ["b", "c", "d"] and not [m for m in listed if m.learner]
    finally:
        for server in servers:
            server.stop()


def test_a_second_learner_is_refused_while_one_waits(tmp_path) -> None:
    """etcd holds one learner at a time: the embedded control plane fills one seat after another."""
    server_tls, client_tls = etcd_pki(tmp_path / "pki")
    first = EtcdServer(data_dir=str(tmp_path / "a"), tls=server_tls, name="a").start()
    try:
        members = EtcdMembers([first.endpoint], client_tls)
        members.add_learner("b", "https://127.0.0.1:1")
        with pytest.raises(Exception, match="learner"):
            members.add_learner("c", "https://127.0.0.1:2")
        waiting = next(m for m in members.list() if m.learner)
        assert not waiting.started
        members.remove(waiting.id)  # a learner that never started costs nothing: one voting member has the quorum
        assert [m.name for m in members.list()] == ["a"]
    finally:
        first.stop()


def test_a_peer_port_takes_members_only_not_another_certificate_of_etcds_ca(tmp_path) -> None:
    """A certificate of etcd's CA that is not a member's (a coordinator's etcd client certificate, here with the
    names a server needs) does not join the cluster as a peer: a learner started with it never starts, and the
    cluster serves on."""
    from pliant.coordinator.etcd_server import MEMBER_CN, EtcdServerError
    from pliant.security.identity import Role
    from pliant.security.issuance import LocalCA

    ca = LocalCA(tmp_path / "pki", lifetime_days=1)
    server_tls = ca.issue("server", Role.COORDINATOR, MEMBER_CN, ["127.0.0.1"])
    client_tls = ca.issue("client", Role.COORDINATOR, "etcd-client")
    rogue_tls = ca.issue("rogue", Role.COORDINATOR, "etcd-client-x", ["127.0.0.1"])
    first = EtcdServer(data_dir=str(tmp_path / "a"), tls=server_tls, name="a").start()
    rogue = EtcdServer(
        data_dir=str(tmp_path / "x"),
        tls=rogue_tls,
        name="x",
        cluster_state="existing",
        log_path=str(tmp_path / "x.log"),
    )
    try:
        members = EtcdMembers([first.endpoint], client_tls)
        url = rogue.peer_url
        listed = wait_for(lambda: _add(members, "x", url), 30, "x added")
        rogue.initial_cluster = initial_cluster(listed, "x", url)
        with pytest.raises(EtcdServerError):
            rogue.start(timeout_s=8.0)
        assert "remote error: tls: bad certificate" in (tmp_path / "x.log").read_text(), "refused by its peer"
        learner = next(m for m in members.list() if url in m.peer_urls)
        assert learner.learner and not learner.started, learner
        assert [m.name for m in members.list() if m.started] == ["a"], "the cluster serves on"
    finally:
        rogue.stop()
        first.stop()
