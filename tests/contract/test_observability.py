"""Status and metrics on a real etcd and a real coordinator: heartbeats carry the step (written to etcd at most every
progress interval, on the member's lease, with the heartbeat pump's next batch), GetJob reports heartbeat age and
step, and the replica's metrics count RPCs, etcd operations and generations on its HTTP endpoint.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from pliant.cli import main
from pliant.coordinator.contract import JobSpec, NotFound
from tests.conftest import wait_for
from tests.fleet import admin_tls

pytestmark = pytest.mark.timeout(60)


def test_heartbeat_steps_reach_status_throttled_and_leave_with_the_lease(make_coordinator, fleet) -> None:
    server = make_coordinator(progress_interval_s=2.0)
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 2, nproc_per_node=2, heartbeat_ttl_s=4, join_grace_s=0.1))
        grant = client.join("job", "a", "127.0.0.1:1", slots=2)
        before = client.get_job("job", progress=True).progress["a"]
        assert before.step == 0 and 0 <= before.heartbeat_age_s <= 1

        client.heartbeat("job", "a", grant.lease_id, step=42)
        client.heartbeat("job", "a", grant.lease_id, step=43)  # within the interval: not written
        # written with the heartbeat pump's next batch (pliant.coordinator.liveness), a moment later
        wait_for(lambda: client.get_job("job", progress=True).progress["a"].step == 42, 2, "step 42 in etcd")
        time.sleep(0.3)  # batches come every 50 ms: 43 would be there by now
        progress = client.get_job("job", progress=True).progress["a"]
        assert progress.step == 42 and progress.step_at > 0
        assert client.get_job("job").progress["a"].heartbeat_age_s == -1  # not asked for: no lease lookups
        store = server.store
        _value, meta = store.client.get(store.progress_key("job", "a"))
        assert meta.lease_id == grant.lease_id  # gone with the membership

        def reported_44() -> bool:
            client.heartbeat("job", "a", grant.lease_id, step=44)
            return client.get_job("job", progress=True).progress["a"].step == 44

        wait_for(reported_44, 5, "the next step after the interval")
        client.leave("job", "a", grant.lease_id)
        assert store.client.get(store.progress_key("job", "a"))[0] is None


def test_status_command_prints_table_and_json(make_coordinator, capsys: pytest.CaptureFixture[str], fleet, pki) -> None:
    server = make_coordinator()
    admin = ["--tls-dir", str(Path(admin_tls(pki).cert).parent)]
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 2, nproc_per_node=2, heartbeat_ttl_s=4, join_grace_s=0.1))
        grant = client.join("job", "a", "127.0.0.1:1")
        client.heartbeat("job", "a", grant.lease_id, step=7)
        wait_for(lambda: client.get_job("job").generation, 10, "the first generation")
    assert main(["status", "--coordinator", server.address, "--json", *admin]) == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    assert (job["job_id"], job["state"], job["world_size"], job["generation"]) == ("job", "running", 2, 1)
    assert [(m["node_id"], m["step"], m["ranks"]) for m in job["members"]] == [("a", 7, [0, 1])]
    assert main(["status", "--coordinator", server.address, "--job", "job", *admin]) == 0
    table = capsys.readouterr().out
    assert "job job: running" in table and "generation 1 (start), world size 2" in table
    assert main(["status", "--coordinator", server.address, "--job", "nope", *admin]) == 1
    assert "job 'nope' does not exist" in capsys.readouterr().err


def test_status_names_an_unreachable_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    from pliant.net import free_port

    assert main(["status", "--coordinator", f"127.0.0.1:{free_port()}", "--insecure"]) == 1
    assert "error" in capsys.readouterr().err


def test_replica_metrics_endpoint_counts_rpcs_etcd_and_generations(make_coordinator, fleet) -> None:
    server = make_coordinator(metrics_listen="127.0.0.1:0")
    assert server.metrics_server is not None
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 1, heartbeat_ttl_s=4, join_grace_s=0.1))
        client.join("job", "a", "127.0.0.1:1")
        with pytest.raises(NotFound):
            client.get_job("missing")
        wait_for(lambda: client.get_job("job").generation, 10, "the first generation")
    registry = server.registry

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("pliant_coordinator_rpcs_total", method="Join", code="OK") == 1.0
    assert sample("pliant_coordinator_rpcs_total", method="GetJob", code="NOT_FOUND") == 1.0
    assert sample("pliant_coordinator_etcd_operation_duration_seconds_count", operation="join") == 1.0
    # The reconciler counts a generation after its transaction commits, so a client may read it a moment earlier.
    wait_for(
        lambda: sample("pliant_coordinator_generations_total", job_id="job", reason="start") == 1.0,
        5,
        "the generation counted",
    )
    wait_for(lambda: sample("pliant_job_world_size", job_id="job") == 1.0, 5, "the job series")
    assert sample("pliant_coordinator_leader") == 1.0
    with urllib.request.urlopen(f"http://{server.metrics_server.address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'pliant_job_members{job_id="job"} 1.0' in text


def test_joining_a_finished_job_is_refused_and_leaves_nothing(make_coordinator, fleet) -> None:
    from pliant.coordinator.contract import FailedPrecondition

    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("done", 1, 2, heartbeat_ttl_s=4))
        client.join("done", "a", "127.0.0.1:1")  # caches the spec in the store
        client.finish_job("done", True, "finished")
        with pytest.raises(FailedPrecondition, match="'done' already succeeded"):
            client.join("done", "b", "127.0.0.1:2")
        assert [m.node_id for m in client.get_job("done").members] == ["a"]
        with pytest.raises(NotFound, match="'nope' does not exist"):
            client.join("nope", "c", "127.0.0.1:3")
