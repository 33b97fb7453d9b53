"""Kubernetes as an operator and two teams run it, for real: the control plane of deploy/ (and its monitoring
component) in its namespace with the Secrets `pliant k8s secrets` printed, each team's namespace given its join token
by `pliant k8s namespace` (the admin's call from the operator's machine), then training jobs rendered by `pliant k8s
job` in the teams' namespaces, their containers run as local processes exactly as written (tests/integration/kubelet.py,
with the Job controller's rules for the agents' elastic Indexed Job, and what a real cluster refuses). Two teams' jobs
train side by side; a deleted agent pod leaves gracefully and its index's new pod joins again; one job is scaled
2 -> 3 -> 2 by patching its parallelism and completions; both end Completed with no agent restarted. TLS everywhere
(etcd clients and peers, the coordinator API, agents' certificates from the bootstrap join); a real Prometheus scrapes
the pods with the PrometheusRule loaded; the dashboard's queries name only metrics a running job exports.
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
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.common import PLIANT, end_soon, read_jsonl
from pliant.agent.contract import ExitCode, left_on
from pliant.certs import load_ca
from pliant.net import free_port
from pliant.security.identity import Role
from pliant.security.issuance import issue_cert, write_tls_dir
from tests.conftest import Spawned, health_serving, wait_for
from tests.integration.kubelet import (
    DEPLOY,
    ROOT,
    Cluster,
    IndexedJob,
    Pod,
    is_indexed,
    load_manifests,
    of_kind,
    parse_manifests,
    trainjob_job,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MONITORING = DEPLOY / "monitoring"
DASHBOARD = MONITORING / "grafana" / "pliant-dashboard.json"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; run scripts/setup (it installs Debian's prometheus package)")
    return path


def _http(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _healthz(address: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _base_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH")
    return {k: v for k, v in os.environ.items() if k in keep}


def _pliant(*args: str) -> str:
    """A ``pliant`` command as the operator types it; its stdout."""
    done = subprocess.run([sys.executable, "-m", "pliant", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@dataclass
class ControlPlane:
    """deploy/ running, with the operator's certificates in ``pki``."""

    cluster: Cluster
    pki: Path
    procs: dict[str, Spawned] = field(default_factory=dict)
    namespaces: set[str] = field(default_factory=set)  # job namespaces given their join token

    def start(self, pod: Pod) -> Spawned:
        argv, env = self.cluster.command(pod)
        self.procs[pod.name] = Spawned(argv, self.cluster.workdir / f"{pod.name}.log", {**_base_env(), **env})
        return self.procs[pod.name]

    def apply(self, manifests: str) -> list[dict[str, Any]]:
        """``kubectl apply -f -``: the objects' plain Jobs run to completion; returns the objects."""
        objects = parse_manifests(manifests)
        for pod in self.cluster.add(objects):
            proc = self.start(pod)
            wait_for(lambda proc=proc: proc.proc.poll() is not None, 90, f"Job pod {pod.name} to complete")
            assert proc.proc.returncode == 0, proc.output()
        return objects

    @property
    def coordinator(self) -> str:
        """A coordinator's API as the operator reaches it (kubectl port-forward, in a cluster)."""
        return f"{self.cluster.pods_of('pliant-coordinator')[0].ip}:29400"

    def namespace(self, namespace: str) -> None:
        """``pliant k8s namespace --namespace NS ... | kubectl apply -f -``, once per namespace."""
        if namespace not in self.namespaces:
            admin = ["--coordinator", self.coordinator, "--tls-dir", str(self.pki / "admin")]
            claim = ["--checkpoint-size=1Gi", "--storage-class=nfs"]  # its TrainJobs' checkpoints
            self.apply(_pliant("k8s", "namespace", f"--namespace={namespace}", *admin, *claim))
            self.namespaces.add(namespace)

    def run_job(self, namespace: str, job: str, nnodes: str, nodes: int, steps: int, *script: str) -> TrainingJob:
        """``pliant k8s job ... | kubectl apply -f -`` in team ``namespace`` for examples/train_elastic.py (and
        ``script``'s arguments), its events and stop file on the job's checkpoint volume."""
        self.namespace(namespace)
        rendered = _pliant(
            "k8s",
            "job",
            f"--namespace={namespace}",
            f"--job={job}",
            "--storage-class=nfs",  # the cluster's default class binds ReadWriteOnce only
            "--max-restarts=0",
            "--image=pliant:0.1.0",
            f"--nnodes={nnodes}",
            f"--nodes={nodes}",
            "--nproc-per-node=1",
            f"--ca-cert={self.pki / 'ca.crt'}",
            "--cpu=1",
            "--memory=2Gi",
            "--rescale-grace=20",
            "/app/examples/train_elastic.py",
            f"--steps={steps}",
            "--step-time=0.05",
            "--events=/checkpoints/events.jsonl",  # the job's own volume
            "--stop-file=/checkpoints/stop",
            *script,
        )
        objects = self.apply(rendered)
        (agents,) = [o for o in of_kind(objects, "Job") if is_indexed(o)]
        controller = IndexedJob(self.cluster, agents, self.start)
        directory = self.cluster.claims[namespace, f"pliant-{job}-checkpoints"]
        return TrainingJob(f"{namespace}.{job}", controller, directory, steps)

    def status(self, job: TrainingJob) -> dict[str, Any]:
        """`pliant status --json` as the operator runs it, with the admin certificate."""
        out = _pliant("status", "--coordinator", self.coordinator, "--json", "--tls-dir", str(self.pki / "admin"))
        return next(j for j in json.loads(out)["jobs"] if j["job_id"] == job.name)


@dataclass
class TrainingJob:
    name: str  # its id in the control plane: <namespace>.<job>
    controller: IndexedJob
    directory: Path  # its checkpoint volume: events.jsonl, stop, and the checkpoints under <job>/
    steps: int

    def events(self) -> list[dict]:
        return read_jsonl(self.directory / "events.jsonl")

    def stepping(self, world: int, after: float = 0.0) -> bool:
        return any(e["world"] == world and e["time"] > after for e in self.events())

    def end(self) -> None:
        """End the training 10 steps after its newest step (the script's stop file)."""
        self.steps = end_soon(self.directory / "events.jsonl", self.directory / "stop", self.steps, margin=10)


def _redone(events: list[dict]) -> list[int]:
    """Steps that more than one generation ran: committed work lost to a world change."""
    ran: dict[int, set[int]] = {}
    for e in events:
        ran.setdefault(e["step"], set()).add(e["generation"])
    return sorted(step for step, generations in ran.items() if len(generations) > 1)


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    from pliant.coordinator.etcd_server import find_etcd_binary

    workdir = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(load_manifests() + load_manifests(MONITORING), workdir, find_etcd_binary())
    plane = ControlPlane(cluster, workdir / "pki")
    # Here a Service's name resolves to a pod's loopback address, and etcd checks a peer's certificate against the
    # address it connects from (127.0.0.1): both go into the certificates, as an ingress's name would in a cluster.
    sans = [p.ip for p in cluster.pods_of("etcd") + cluster.pods_of("pliant-coordinator")] + ["127.0.0.1"]
    plane.apply(_pliant("k8s", "secrets", f"--dir={plane.pki}", *(f"--san={s}" for s in sans)))
    try:
        for pod in cluster.pods_of("etcd"):
            plane.start(pod)
        for pod in cluster.pods_of("etcd"):
            url = f"http://{pod.ip}:{pod.port('metrics')}/health"
            wait_for(lambda url=url: _healthy(url), 60, f"etcd member {url}")
        for pod in cluster.pods_of("pliant-coordinator"):
            plane.start(pod)
        for address in [f"{p.ip}:{p.port('health')}" for p in cluster.pods_of("pliant-coordinator")]:
            wait_for(lambda a=address: health_serving(a), 60, f"coordinator health {address}")
        yield plane
    except BaseException:
        for name, proc in plane.procs.items():
            print(f"--- {name} ---\n{proc.output()[-3000:]}")
        raise
    finally:
        for proc in plane.procs.values():
            proc.kill()


def _healthy(url: str) -> bool:
    try:
        return json.loads(_http(url)).get("health") == "true"
    except (OSError, ValueError):
        return False


@pytest.mark.long
def test_two_jobs_train_side_by_side_scale_drain_and_complete(control_plane: ControlPlane) -> None:
    plane = control_plane
    gamma = plane.run_job("team-a", "gamma", "1:2", 2, 100000)
    beta = plane.run_job("team-b", "beta", "1:3", 2, 100000)
    try:
        wait_for(lambda: gamma.stepping(2) and beta.stepping(2), 180, "both teams' jobs stepping at world 2")
        assert plane.status(gamma)["world_size"] == plane.status(beta)["world_size"] == 2
        pod = gamma.controller.pods()[0]
        assert _healthz(f"{pod.ip}:{pod.port('metrics')}") == (200, "ok\n"), "the startup and liveness probes' endpoint"

        # One job finishes: its Job is Complete, every agent exited 0, none was restarted.
        gamma.end()
        wait_for(lambda: gamma.controller.condition, 120, "gamma's agents to end")
        assert gamma.controller.condition == "Complete", gamma.controller.exits
        assert sorted((index, code) for _pod, index, code in gamma.controller.exits) == [(0, 0), (1, 0)]
        assert plane.status(gamma)["state"] == "succeeded"

        # The other is scaled by its knob: kubectl patch job pliant-beta -p '{"spec":{"parallelism":3,...}}'.
        beta.controller.patch(3, 3)
        wait_for(lambda: beta.stepping(3), 120, "beta stepping at world 3")
        # A deleted pod (a drain, a spot reclaim): SIGTERM to its agent, which leaves in place; its index gets a new
        # pod, which joins again.
        victim = beta.controller.pods()[1]
        process = beta.controller.process(victim.name)
        deleted = _now(beta)
        beta.controller.delete_pod(victim.name)
        wait_for(lambda: process.proc.poll() is not None, 60, "the deleted pod's agent to leave")
        assert process.proc.returncode == left_on(signal.SIGTERM), process.output()[-3000:]
        wait_for(lambda: beta.stepping(2, after=deleted), 60, "beta stepping without the deleted pod")
        wait_for(lambda: beta.stepping(3, after=_last_world(beta, 2)), 120, "the index's new pod joined")
        assert victim.name not in {p.name for p in beta.controller.pods()}
        # And back to two.
        grown = _now(beta)
        beta.controller.patch(2, 2)
        wait_for(lambda: beta.stepping(2, after=grown), 90, "beta back at world 2")
        assert not _redone(beta.events()), "a graceful leave or a scale-down loses no committed step"

        beta.end()
        wait_for(lambda: beta.controller.condition, 120, "beta's agents to end")
        assert beta.controller.condition == "Complete", beta.controller.exits
        assert plane.status(beta)["state"] == "succeeded"
        # The two that left on SIGTERM (the deleted pod and the index scaled away) are not failures: no agent restarted.
        left = sorted(index for _pod, index, code in beta.controller.exits if code == left_on(signal.SIGTERM))
        assert left == [1, 2] and beta.controller.failed_pods == 0, beta.controller.exits
        assert all(code in (0, left_on(signal.SIGTERM)) for _pod, _index, code in beta.controller.exits)
        print(f"\ngamma's pods: {gamma.controller.exits}\nbeta's pods: {beta.controller.exits}")
    finally:
        gamma.controller.close()
        beta.controller.close()


def test_a_failed_job_fails_its_agents_job_at_once(control_plane: ControlPlane) -> None:
    """The training job fails (its script exits at every start, no restart left): the first agent to hear it exits 1,
    and the pod failure policy fails the Job at once (its other pods are stopped), restarting none."""
    failing = control_plane.run_job("team-a", "delta", "1:2", 2, 100, "--engine=nope")
    try:
        wait_for(lambda: failing.controller.condition, 120, "delta's agents to end")
        assert failing.controller.condition == "Failed", failing.controller.exits
        assert [code for _pod, _index, code in failing.controller.exits] == [ExitCode.JOB_FAILED]
        assert failing.controller.failed_pods == 0, "failed by the policy, not by the backoff limit"
        assert control_plane.status(failing)["state"] == "failed"
    finally:
        failing.controller.close()


def test_a_trainjob_on_the_pliant_runtime_trains_elastically_and_completes(control_plane: ControlPlane) -> None:
    """Kubeflow Trainer: the ClusterTrainingRuntime `pliant k8s trainer-runtime` prints and a TrainJob as
    examples/k8s/trainjob.yaml writes it, in a third team's namespace: its pods create the pliant job with the
    namespace's token and train at numNodes; a deleted pod leaves, the job trains on without it and its replacement
    joins again; the TrainJob's Job ends Complete."""
    plane = control_plane
    plane.namespace("team-c")
    pin = f"--ca-cert={plane.pki / 'ca.crt'}"
    (runtime,) = parse_manifests(_pliant("k8s", "trainer-runtime", "--image=pliant:0.1.0", pin, "--max-restarts=0"))
    (trainjob,) = parse_manifests((ROOT / "examples" / "k8s" / "trainjob.yaml").read_text())
    trainjob["metadata"]["namespace"] = "team-c"
    trainer = trainjob["spec"]["trainer"]
    assert trainer["args"][0] == "/app/examples/train_elastic.py"
    trainer |= {"numNodes": 2, "numProcPerNode": 1}
    trainer["args"] = [*trainer["args"][:1], "--steps=100000", "--step-time=0.05"]
    trainer["args"] += ["--events=/checkpoints/events.jsonl", "--stop-file=/checkpoints/stop"]
    controller = IndexedJob(plane.cluster, trainjob_job(runtime, trainjob), plane.start)
    job = TrainingJob("team-c.elastic-mlp", controller, plane.cluster.claims["team-c", "pliant-checkpoints"], 100000)
    try:
        wait_for(lambda: job.stepping(2) or controller.refused, 180, "the TrainJob stepping at numNodes")
        assert not controller.refused, controller.refused
        victim = controller.pods()[1]
        process = controller.process(victim.name)
        deleted = _now(job)
        controller.delete_pod(victim.name)
        wait_for(lambda: process.proc.poll() is not None, 60, "the deleted pod's agent to leave")
        assert process.proc.returncode == left_on(signal.SIGTERM), process.output()[-3000:]
        wait_for(lambda: job.stepping(1, after=deleted), 60, "the job training on without the deleted pod")
        wait_for(lambda: job.stepping(2, after=_last_world(job, 1)), 120, "the replacement pod joined")
        assert not _redone(job.events()), "a graceful leave loses no committed step"
        job.end()
        wait_for(lambda: controller.condition, 120, "the TrainJob's pods to end")
        assert controller.condition == "Complete", controller.exits
        assert plane.status(job)["state"] == "succeeded"
    finally:
        controller.close()


def _now(job: TrainingJob) -> float:
    return max((e["time"] for e in job.events()), default=0.0)


def _last_world(job: TrainingJob, world: int) -> float:
    return max((e["time"] for e in job.events() if e["world"] == world), default=0.0)


@dataclass
class Deployment:
    """Two jobs training on the control plane: ``alpha`` on two agents, ``epsilon`` on one."""

    alpha: TrainingJob
    epsilon: TrainingJob

    @property
    def jobs(self) -> tuple[TrainingJob, TrainingJob]:
        return self.alpha, self.epsilon


@pytest.fixture(scope="module")
def deployment(control_plane: ControlPlane) -> Iterator[Deployment]:
    alpha = control_plane.run_job("team-a", "alpha", "1:2", 2, 100000)
    epsilon = control_plane.run_job("team-b", "epsilon", "1:1", 1, 100000)
    try:
        wait_for(lambda: alpha.stepping(2) and epsilon.stepping(1), 180, "alpha at world 2 and epsilon stepping")
        yield Deployment(alpha, epsilon)
    finally:
        alpha.controller.close()
        epsilon.controller.close()


def _targets(plane: ControlPlane, deployment: Deployment) -> list[str]:
    """What the ServiceMonitor (the coordinators' Service) and the PodMonitor (every agent pod) select."""
    coordinators = [f"{p.ip}:{p.port('metrics')}" for p in plane.cluster.pods_of("pliant-coordinator")]
    agents = [pod for job in deployment.jobs for pod in job.controller.pods()]
    return coordinators + [f"{p.ip}:{p.port('metrics')}" for p in agents]


def _rule_group(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (rule,) = of_kind(docs, "PrometheusRule")
    return rule["spec"]


@pytest.fixture(scope="module")
def prometheus(
    control_plane: ControlPlane, deployment: Deployment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Any]]:
    """A real Prometheus scraping the deployment every second, with the PrometheusRule's rules loaded."""
    binary = _tool("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "pliant-rules.yaml").write_text(yaml.safe_dump(_rule_group(control_plane.cluster.docs)))
    targets = _targets(control_plane, deployment)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["pliant-rules.yaml"],
        "scrape_configs": [{"job_name": "pliant", "static_configs": [{"targets": targets}]}],
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


def test_prometheus_scrapes_both_jobs_each_series_with_its_job(
    deployment: Deployment, prometheus: Callable[[str], Any]
) -> None:
    query = prometheus
    world = query('max(pliant_job_world_size{job_id="team-a.alpha"})')
    assert float(world[0]["value"][1]) == len(deployment.alpha.controller.pods()) == 2
    assert float(query("sum(pliant_coordinator_leader)")[0]["value"][1]) == 1.0
    assert len(query('pliant_worker_world_size{job_id="team-a.alpha"} == 2')) == 2
    wait_for(lambda: len(query("sum by (job_id) (rate(pliant_worker_samples_total[5s])) > 0")) == 2, 30, "both rates")
    wait_for(lambda: query("sum(rate(pliant_worker_step_duration_seconds_count[5s])) > 0"), 30, "step histogram")
    served = query('{__name__=~"pliant_(worker|agent|user)_.+"}')
    assert served and not [r["metric"] for r in served if "job_id" not in r["metric"]], (
        "every node series names its job"
    )
    assert {r["metric"]["job_id"] for r in served} == {"team-a.alpha", "team-b.epsilon"}
    assert not query('{__name__=~".+_created"}'), "no _created series"
    assert not query('ALERTS{alertstate="firing"}')


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in board["panels"] for t in panel["targets"]]


def test_dashboard_and_rules_name_only_exported_metrics(
    control_plane: ControlPlane, deployment: Deployment, prometheus: Callable[[str], Any]
) -> None:
    query = prometheus
    exported = {r["metric"]["__name__"] for r in query('{__name__=~"pliant_.+"}')}
    recovery = 'pliant_worker_recovery_phase_seconds_count{phase="decide"}'
    assert query(recovery), "the recovery phases exist at zero before any failure"
    for target in _targets(control_plane, deployment):  # families declared but without a series yet
        for line in _http(f"http://{target}/metrics").splitlines():
            if line.startswith("# TYPE pliant_"):
                _, _, name, kind = line.split()
                exported |= {name} | (
                    {f"{name}_bucket", f"{name}_count", f"{name}_sum"} if kind == "histogram" else set()
                )
    names = set()
    rule_exprs = [r["expr"] for g in _rule_group(control_plane.cluster.docs)["groups"] for r in g["rules"]]
    for expr in _dashboard_exprs() + rule_exprs:
        names |= set(re.findall(r"\b(pliant_[a-z_]+)", expr))
        if expr in rule_exprs:
            continue
        for job in ("team-a.alpha", "team-b.epsilon"):  # every panel runs, and shows the job selected and no other
            result = query(expr.replace("$__rate_interval", "10s").replace('"$job_id"', f'"{job}"'))
            if "$job_id" in expr:
                assert {r["metric"].get("job_id", job) for r in result} <= {job}, (expr, result)
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"dashboard or rules name metrics the job does not export: {missing}"


def test_promtool_checks_rules_and_metrics(control_plane: ControlPlane, deployment: Deployment, tmp_path: Path) -> None:
    promtool = _tool("promtool")
    (tmp_path / "pliant-rules.yaml").write_text(yaml.safe_dump(_rule_group(control_plane.cluster.docs)))
    shutil.copy(MONITORING / "prometheus" / "alerts-test.yaml", tmp_path / "alerts-test.yaml")
    for args in (["check", "rules", "pliant-rules.yaml"], ["test", "rules", "alerts-test.yaml"]):
        result = subprocess.run([promtool, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    for target in _targets(control_plane, deployment):
        text = _http(f"http://{target}/metrics")
        result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{target}: {result.stdout}{result.stderr}"


def test_the_api_refuses_what_the_manifests_do_not_grant(
    control_plane: ControlPlane, deployment: Deployment, tmp_path: Path
) -> None:
    """Plaintext clients get nothing; an agent's certificate may not finish the job; etcd refuses clients without a
    certificate from its CA."""
    cluster = control_plane.cluster
    coordinator = control_plane.coordinator
    plain = subprocess.run(
        [sys.executable, "-m", "pliant", "status", "--coordinator", coordinator, "--insecure"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.returncode == 1, plain.stdout
    pod = deployment.alpha.controller.pods()[0]
    member = f"{pod.namespace}.{pod.name}"  # an agent's own certificate, as its bootstrap join got it
    agent_dir = write_tls_dir(
        tmp_path / "agent",
        load_ca(str(control_plane.pki)).cert_pem,
        issue_cert(load_ca(str(control_plane.pki)), Role.AGENT, member, [], 1),
    )
    finish = subprocess.run(
        [
            *PLIANT,
            "job",
            "finish",
            deployment.alpha.name,
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
    assert control_plane.status(deployment.alpha)["state"] == "running"
