"""deploy/ checked for real: the manifests' containers run as local processes and train, with TLS everywhere (etcd
clients and peers, the coordinator API) and the Secrets an operator creates with `pliant certs`; a real Prometheus
scrapes them with the manifests' ServiceMonitor targets and the PrometheusRule loaded; the dashboard's queries name only
metrics that the running job exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pliant.net import free_port
from pliant.tls import LocalCA, Role
from tests.conftest import Spawned, health_serving, wait_for
from tests.integration.kubelet import DEPLOY, Cluster, load_manifests, of_kind, selects

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DASHBOARD = DEPLOY / "grafana" / "pliant-dashboard.json"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; run scripts/setup (it installs Debian's prometheus package)")
    return path


def _http(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _metric(text: str, name: str) -> float | None:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    return max(values) if values else None


def _scrape_step(address: str) -> float:
    try:
        return _metric(_http(f"http://{address}/metrics"), "pliant_worker_step") or 0.0
    except OSError:
        return 0.0


class Deployment:
    """The manifests running as local processes."""

    def __init__(self, cluster: Cluster, procs: dict[str, Spawned]) -> None:
        self.cluster = cluster
        self.procs = procs

    def metrics_targets(self) -> list[str]:
        """HOST:PORT of every pod behind a Service the ServiceMonitor selects, on the endpoint's port."""
        (monitor,) = of_kind(self.cluster.docs, "ServiceMonitor")
        wanted = {e["port"] for e in monitor["spec"]["endpoints"]}
        values = monitor["spec"]["selector"]["matchExpressions"][0]["values"]
        targets = []
        for service in of_kind(self.cluster.docs, "Service"):
            if service["metadata"]["labels"].get("app.kubernetes.io/name") not in values:
                continue
            ports = [p["name"] for p in service["spec"]["ports"] if p["name"] in wanted]
            for pod in self.cluster.pods:
                if selects(service, pod.labels):
                    targets += [f"{pod.ip}:{pod.port(port)}" for port in ports]
        return sorted(set(targets))


def make_secrets(cluster: Cluster, workdir: Path) -> dict[str, dict[str, bytes]]:
    """The Secrets the manifests mount, as an operator would create them with `pliant certs` (one CA for etcd, one
    for pliant), with the names and addresses the pods are reached by."""
    etcd_ca, pliant_ca = LocalCA(workdir / "etcd-ca"), LocalCA(workdir / "pliant-ca")

    def files(tls: Any, prefix: str = "tls") -> dict[str, bytes]:
        return {
            "ca.crt": Path(tls.ca).read_bytes(),
            f"{prefix}.crt": Path(tls.cert).read_bytes(),
            f"{prefix}.key": Path(tls.key).read_bytes(),
        }

    # etcd checks a peer's certificate against the address it connects from: locally that is 127.0.0.1, not the pod's.
    etcd_names = [n for p in cluster.pods_of("etcd") for n in (f"{p.name}.etcd", p.ip)] + ["127.0.0.1"]
    coordinator_names = ["pliant-coordinator", *(p.ip for p in cluster.pods_of("pliant-coordinator"))]
    coordinator = pliant_ca.issue("coordinator", Role.COORDINATOR, "coordinator", coordinator_names)
    agents: dict[str, bytes] = {}
    for pod in cluster.pods_of("pliant-agent"):
        agents.update(files(pliant_ca.issue(pod.name, Role.AGENT, pod.name), pod.name))
    return {
        "etcd-tls": files(etcd_ca.issue("etcd", Role.COORDINATOR, "etcd", etcd_names)),
        "pliant-etcd-client-tls": files(etcd_ca.issue("etcd-client", Role.COORDINATOR, "pliant-coordinator")),
        "pliant-coordinator-tls": files(coordinator),
        "pliant-admin-tls": files(pliant_ca.issue("admin", Role.ADMIN, "operator")),
        "pliant-agent-tls": {"ca.crt": pliant_ca.ca.cert_pem, **{k: v for k, v in agents.items() if k != "ca.crt"}},
        "pliant-join-token": {"token": b"deploy-test-join-token-0123456789"},
    }


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from pliant.coordinator.etcd_server import find_etcd_binary

    workdir = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(load_manifests(), workdir, find_etcd_binary())
    cluster.secrets = make_secrets(cluster, workdir)
    procs: dict[str, Spawned] = {}

    def start(workload: str) -> None:
        for pod in cluster.pods_of(workload):
            argv, env = cluster.command(pod)
            procs[pod.name] = Spawned(argv, workdir / f"{pod.name}.log", {**_base_env(), **env})

    try:
        start("etcd")
        for pod in cluster.pods_of("etcd"):
            url = f"http://{pod.ip}:{pod.port('metrics')}/health"
            wait_for(lambda url=url: _healthy(url), 60, f"etcd member {url}")
        start("pliant-coordinator")
        for address in [f"{p.ip}:{p.port('health')}" for p in cluster.pods_of("pliant-coordinator")]:
            wait_for(lambda a=address: health_serving(a), 60, f"coordinator health {address}")
        start("pliant-create-job")  # the admin's Job: create the job with the token's Secret
        creator = procs[cluster.pods_of("pliant-create-job")[0].name]
        wait_for(lambda: creator.proc.poll() is not None, 60, "the create-job Job to complete")
        assert creator.proc.returncode == 0, creator.output()
        assert "job example created" in creator.output()
        start("pliant-agent")
        agents = [f"{p.ip}:{p.port('metrics')}" for p in cluster.pods_of("pliant-agent")]
        wait_for(lambda: all(_scrape_step(a) >= 5 for a in agents), 180, "both agents' workers past step 5")
        yield Deployment(cluster, procs)
    except BaseException:
        for name, proc in procs.items():
            print(f"--- {name} ---\n{proc.output()[-3000:]}")
        raise
    finally:
        for proc in procs.values():
            proc.kill()


def _base_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH")
    return {k: v for k, v in os.environ.items() if k in keep}


def _healthy(url: str) -> bool:
    try:
        return json.loads(_http(url)).get("health") == "true"
    except (OSError, ValueError):
        return False


def test_manifests_run_as_written_and_train(deployment: Deployment) -> None:
    cluster = deployment.cluster
    (job,) = _status_all(cluster)
    agents = cluster.pods_of("pliant-agent")
    assert job["state"] == "running"
    assert job["world_size"] == 2 * len(agents)
    assert sorted(m["node_id"] for m in job["members"]) == sorted(p.name for p in agents)
    assert all(m["heartbeat_age_s"] is not None and m["heartbeat_age_s"] <= 5 for m in job["members"])
    before = [_scrape_step(f"{p.ip}:9400") for p in agents]
    wait_for(
        lambda: all(_scrape_step(f"{p.ip}:9400") > b for p, b in zip(agents, before, strict=True)),
        30,
        "training steps advancing on every agent",
    )
    print("\nsmoke test ran:")
    for pod in cluster.pods:
        argv, _env = cluster.command(pod)
        print(f"  {pod.name} ({pod.ip}): {' '.join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv))}")


def _rule_group(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (rule,) = of_kind(docs, "PrometheusRule")
    return rule["spec"]


@pytest.fixture(scope="module")
def prometheus(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Any]]:
    """A real Prometheus scraping the deployment every second, with the PrometheusRule's rules loaded."""
    binary = _tool("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "pliant-rules.yaml").write_text(yaml.safe_dump(_rule_group(deployment.cluster.docs)))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["pliant-rules.yaml"],
        "scrape_configs": [{"job_name": "pliant", "static_configs": [{"targets": deployment.metrics_targets()}]}],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port()}"
    proc = Spawned(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address={address}",
        ],
        workdir / "prometheus.log",
    )

    def query(expr: str) -> Any:
        url = f"http://{address}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = json.loads(_http(url, timeout=5))
        assert body["status"] == "success", body
        return body["data"]["result"]

    try:
        wait_for(lambda: _ready(address), 60, "prometheus ready")
        targets = deployment.metrics_targets()
        wait_for(lambda: len(query('up{job="pliant"} == 1')) == len(targets), 60, "every target scraped")
        yield query
    finally:
        proc.kill()
        print(proc.output()[-2000:] if proc.proc.returncode not in (None, 0, -9) else "")


def _ready(address: str) -> bool:
    try:
        return "Ready" in _http(f"http://{address}/-/ready")
    except OSError:
        return False


def test_prometheus_scrapes_the_job(deployment: Deployment, prometheus: Callable[[str], Any]) -> None:
    query = prometheus
    agents = deployment.cluster.pods_of("pliant-agent")
    world = query("max(pliant_job_world_size)")
    assert float(world[0]["value"][1]) == 2 * len(agents)
    assert float(query("sum(pliant_coordinator_leader)")[0]["value"][1]) == 1.0
    assert len(query("pliant_worker_world_size == 4")) == len(agents)
    wait_for(lambda: query("sum(rate(pliant_worker_samples_total[5s])) > 0"), 30, "a positive samples rate")
    wait_for(lambda: query("sum(rate(pliant_worker_step_duration_seconds_count[5s])) > 0"), 30, "step histogram")
    joined = query(
        "sum by (job_id) (rate(pliant_worker_steps_total[5s]) * on (instance) group_left (job_id) pliant_agent_info)"
    )
    assert [r["metric"]["job_id"] for r in joined] == ["example"]
    assert not query('ALERTS{alertstate="firing"}')
    print("\nper-node scrape (agents):")
    for pod in agents:
        inst = f"{pod.ip}:{pod.port('metrics')}"
        duration = query(f'scrape_duration_seconds{{instance="{inst}"}}')[0]["value"][1]
        samples = query(f'scrape_samples_scraped{{instance="{inst}"}}')[0]["value"][1]
        print(f"  {pod.name}: scrape {float(duration) * 1000:.1f} ms, {samples} samples")


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in board["panels"] for t in panel["targets"]]


def test_dashboard_and_rules_name_only_exported_metrics(
    deployment: Deployment, prometheus: Callable[[str], Any]
) -> None:
    query = prometheus
    exported = {r["metric"]["__name__"] for r in query('{__name__=~"pliant_.+"}')}
    for target in deployment.metrics_targets():  # families declared but without a series yet (no exit so far)
        for line in _http(f"http://{target}/metrics").splitlines():
            if line.startswith("# TYPE pliant_"):
                _, _, name, kind = line.split()
                exported |= {name} | (
                    {f"{name}_bucket", f"{name}_count", f"{name}_sum"} if kind == "histogram" else set()
                )
    names = set()
    rule_exprs = [r["expr"] for g in _rule_group(deployment.cluster.docs)["groups"] for r in g["rules"]]
    for expr in _dashboard_exprs() + rule_exprs:
        names |= set(re.findall(r"\b(pliant_[a-z_]+)", expr))
        if expr in rule_exprs:
            continue
        query(expr.replace("$__rate_interval", "10s").replace('"$job_id"', '".*"'))  # it parses and runs
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"dashboard or rules name metrics the job does not export: {missing}"
    print(f"\n{len(exported)} pliant metrics exported: {', '.join(sorted(exported))}")


def test_promtool_checks_rules_and_metrics(deployment: Deployment, tmp_path: Path) -> None:
    promtool = _tool("promtool")
    (tmp_path / "pliant-rules.yaml").write_text(yaml.safe_dump(_rule_group(deployment.cluster.docs)))
    shutil.copy(DEPLOY / "prometheus" / "alerts-test.yaml", tmp_path / "alerts-test.yaml")
    for args in (["check", "rules", "pliant-rules.yaml"], ["test", "rules", "alerts-test.yaml"]):
        result = subprocess.run([promtool, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    for target in deployment.metrics_targets():
        text = _http(f"http://{target}/metrics")
        result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{target}: {result.stdout}{result.stderr}"


def _status_all(cluster: Cluster) -> list[dict[str, Any]]:
    """`pliant status --json` as the operator runs it: with the admin certificate of Secret pliant-admin-tls."""
    coordinator = cluster.pods_of("pliant-coordinator")[0]
    admin = cluster.workdir / "pods" / cluster.pods_of("pliant-create-job")[0].name / "secret-admin-tls"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pliant",
            "status",
            "--coordinator",
            f"{coordinator.ip}:29400",
            "--json",
            "--tls-dir",
            str(admin),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(out.stdout)["jobs"]


def test_the_api_refuses_what_the_manifests_do_not_grant(deployment: Deployment) -> None:
    """Plaintext clients get nothing; an agent's certificate may not finish the job; etcd refuses clients without a
    certificate from its CA."""
    cluster = deployment.cluster
    coordinator = f"{cluster.pods_of('pliant-coordinator')[0].ip}:29400"
    plain = subprocess.run(
        [sys.executable, "-m", "pliant", "status", "--coordinator", coordinator, "--insecure"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.returncode == 1, plain.stdout
    agent_dir = cluster.workdir / "pods" / "pliant-agent-0" / "secret-tls" / "pliant-agent-0"
    finish = subprocess.run(
        [
            sys.executable,
            "-m",
            "pliant",
            "job",
            "finish",
            "example",
            "--coordinator",
            coordinator,
            "--tls-dir",
            str(agent_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert finish.returncode == 1 and "FinishJob needs an admin certificate" in finish.stderr, finish.stderr
    etcd = cluster.pods_of("etcd")[0]
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # no client certificate, trust anything
    with pytest.raises(OSError):  # etcd ends the handshake (or the request) of a client without a certificate
        urllib.request.urlopen(f"https://{etcd.ip}:2379/version", timeout=5, context=context).read()
    assert _status_all(cluster)[0]["state"] == "running"


def _status(cluster: Cluster) -> dict[str, Any]:
    return _status_all(cluster)[0]


def test_scaling_the_agent_statefulset_down_and_up(deployment: Deployment) -> None:
    """`kubectl scale` as the pods see it: the highest pod gets its preStop (SIGTERM to the agent, PID 1 in its
    container) and leaves gracefully; a new pod with the same command joins again."""
    cluster = deployment.cluster
    last = cluster.pods_of("pliant-agent")[-1]
    first = cluster.pods_of("pliant-agent")[0]
    before = _status(cluster)["generation"]
    proc = deployment.procs[last.name]
    os.kill(proc.pid, signal.SIGTERM)  # what the preStop hook's `kill -TERM 1` does
    wait_for(lambda: proc.proc.poll() is not None, 60, "the leaving agent to exit")
    assert proc.proc.returncode == 0, proc.output()[-3000:]
    down = wait_for(
        lambda: (j := _status(cluster))["world_size"] == 2 and j["generation"] > before and j,
        30,
        "the job at world size 2",
    )
    assert down["generation_reason"] == "leave" and down["restarts_used"] == 0
    step = _scrape_step(f"{first.ip}:9400")
    wait_for(lambda: _scrape_step(f"{first.ip}:9400") > step, 60, "the remaining node stepping")

    argv, env = cluster.command(last)
    deployment.procs[last.name] = Spawned(argv, cluster.workdir / f"{last.name}-again.log", {**_base_env(), **env})
    up = wait_for(
        lambda: (j := _status(cluster))["world_size"] == 4 and j["generation"] > down["generation"] and j,
        60,
        "the job back at world size 4",
    )
    assert up["generation_reason"] == "join"
    wait_for(lambda: _scrape_step(f"{last.ip}:9400") > 0, 60, "the new pod's workers stepping")
