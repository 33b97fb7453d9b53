"""deploy/ and `pliant k8s` checked offline: the control plane's manifests, its Secrets, a namespace's join Secret and
two training jobs in two namespaces rendered with different parameters, all valid under kubernetes-validate --strict at
the minimum Kubernetes version pliant states and at the newest (the operator's ServiceMonitor, PodMonitor and
PrometheusRule against their own schemas, unknown fields refused); the base kustomization holds built-in kinds only
(monitoring is its own component); the wiring consistent (probes, ports, Services, the names the jobs and the control
plane share, the Dockerfile's sources); two jobs side by side sharing no name or selector; nothing a job namespace gets
mounts, references or grants a Secret of the control plane; the same flags render the same bytes; the dashboard
well-formed. The running checks (containers as written, two teams' jobs trained, scaled and drained, a real
Prometheus, promtool) are in tests/integration/test_deploy.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pliant.agent.contract import ExitCode, left_on
from pliant.errors import ConfigError
from pliant.k8s import names
from pliant.k8s.cli import _dump
from pliant.k8s.job import JobUnit, render_job
from pliant.k8s.secrets import ControlPlanePki, join_secret, render_secrets
from pliant.security.identity import ca_fingerprint
from tests.integration.kubelet import DEPLOY, ROOT, Cluster, Refused, load_manifests, of_kind, selects

CONTROL_PLANE = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
MONITORING = DEPLOY / "monitoring"
CONTROL_PLANE_SECRETS = {names.ETCD_TLS, names.ETCD_CLIENT_TLS, names.COORDINATOR_TLS, names.SIGNING_CA}
LABELS = {f"app.kubernetes.io/{k}" for k in ("name", "instance", "version", "component", "part-of", "managed-by")}
HASH = "sha256:" + "ab" * 32


def _units(tmp_path: Path) -> dict[str, JobUnit]:
    """Two jobs in two teams' namespaces, the second with every optional part: a script ConfigMap, GPUs, an existing
    claim, an admin-created job's token Secret."""
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    small = JobUnit(
        "alpha", "reg/pliant:0.1.0", ("/app/examples/train_elastic.py", "--steps", "100"), HASH, namespace="team-a"
    )
    large = JobUnit(
        "beta-2",
        "reg/pliant:0.1.0",
        ("--lr", "0.1"),
        HASH,
        namespace="team-b",
        node_selector=("cloud.google.com/gke-accelerator=nvidia-h100-80gb",),
        tolerations=("nvidia.com/gpu:NoSchedule", "dedicated=training:NoExecute"),
        min_nodes=2,
        max_nodes=8,
        nodes=3,
        nproc_per_node=8,
        script=script,
        cpu="32",
        memory="256Gi",
        gpus=8,
        shm_size="64Gi",
        checkpoint_claim="shared-ckpt",
        token_secret="beta-token",
        storage_class="fast",
        rescale_grace_s=120,
    )
    return {"alpha": small, "beta-2": large}


def _jobs(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    return {job: render_job(unit) for job, unit in _units(tmp_path).items()}


def _validate(files: list[Path], version: str) -> set[str]:
    """kubernetes-validate --strict on ``files`` at Kubernetes ``version``; the kinds that passed."""
    tool = Path(sys.executable).with_name("kubernetes-validate")
    result = subprocess.run(
        [str(tool), "--strict", "-k", version, *map(str, files)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"Kubernetes {version}: {result.stdout}{result.stderr}"
    return {r.split("/")[0] for r in re.findall(r"passed for resource (\S+)", result.stdout + result.stderr)}


def _newest_kubernetes() -> str:
    import kubernetes_validate

    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    found = [d.name.split("-")[0][1:] for d in schemas.glob("v*-local-strict")]
    return max(found, key=lambda v: tuple(int(x) for x in v.split(".")))


@pytest.mark.parametrize("version", ["minimum", "newest"])
def test_every_manifest_passes_kubernetes_validate_strict(tmp_path: Path, version: str) -> None:
    """At the minimum version pliant states (names.MIN_KUBERNETES) and the newest kubernetes-validate knows."""
    files = list(CONTROL_PLANE)
    for job, objects in _jobs(tmp_path).items():
        files.append(tmp_path / f"{job}.yaml")
        files[-1].write_text(_dump(objects))
    files.append(tmp_path / "secrets.yaml")
    pki = ControlPlanePki.ensure(tmp_path / "pki")
    files[-1].write_text(_dump([*render_secrets(pki), join_secret("team-a", "t" * 43)]))
    kinds = _validate(files, names.MIN_KUBERNETES if version == "minimum" else _newest_kubernetes())
    assert {
        "namespace",
        "statefulset",
        "deployment",
        "service",
        "poddisruptionbudget",
        "job",
        "networkpolicy",
        "secret",
        "configmap",
        "persistentvolumeclaim",
    } <= kinds


def test_the_base_kustomization_needs_no_crd_and_monitoring_is_a_component(tmp_path: Path) -> None:
    """`kubectl apply -k deploy/` on a cluster without the Prometheus Operator: every object of the base is a built-in
    kind (kubernetes-validate has a schema for each, at the minimum version); the operator's objects and the dashboard
    are the monitoring component's."""
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in CONTROL_PLANE)
    assert "configMapGenerator" not in kust
    kinds = _validate([DEPLOY / r for r in kust["resources"]], names.MIN_KUBERNETES)
    assert kinds == {"namespace", "statefulset", "deployment", "service", "poddisruptionbudget", "networkpolicy"}
    monitoring = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert monitoring["resources"] == ["monitoring.yaml"]
    (generator,) = monitoring["configMapGenerator"]
    assert all((MONITORING / f).is_file() for f in generator["files"])


def _unknown_fields(given: Any, parsed: Any, path: str = "") -> list[str]:
    if isinstance(given, dict):
        out = []
        for key, value in given.items():
            if not isinstance(parsed, dict) or key not in parsed:
                out.append(f"{path}.{key}")
            else:
                out += _unknown_fields(value, parsed[key], f"{path}.{key}")
        return out
    if isinstance(given, list):
        return [
            u for i, (g, p) in enumerate(zip(given, parsed, strict=True)) for u in _unknown_fields(g, p, f"{path}[{i}]")
        ]
    return []


def test_operator_resources_match_their_crd_schemas_strictly() -> None:
    from cloudcoil.models.prometheus_operator import v1

    docs = [d for d in yaml.safe_load_all((MONITORING / "monitoring.yaml").read_text()) if d]
    assert sorted(d["kind"] for d in docs) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
    for doc in docs:
        model = getattr(v1, doc["kind"]).model_validate(doc)
        dumped = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
        assert not _unknown_fields(doc, dumped), f"{doc['kind']}: fields unknown to its CRD"
    bad = json.loads(json.dumps(docs[0]))
    bad["spec"]["endpoints"][0]["prot"] = "metrics"
    parsed = getattr(v1, bad["kind"]).model_validate(bad).model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert _unknown_fields(bad, parsed) == [".spec.endpoints[0].prot"]


def test_the_control_plane_and_the_jobs_agree_on_names_ports_and_secrets(tmp_path: Path) -> None:
    docs = load_manifests()
    cluster = Cluster(docs, tmp_path, "etcd")
    assert [len(cluster.pods_of(w)) for w in ("etcd", "pliant-coordinator")] == [3, 2]
    for service in of_kind(docs, "Service"):  # every Service selects pods that declare its ports
        pods = [p for p in cluster.pods if selects(service, p.labels)]
        assert pods, service["metadata"]["name"]
        declared = {p["name"] for p in pods[0].container["ports"]}
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["name"]) in declared | {port["port"]}, (service["metadata"], port)
    (service,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == names.COORDINATOR]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert (ports["grpc"], ports["bootstrap"]) == (names.API_PORT, names.BOOTSTRAP_PORT)
    coordinator = cluster.pods_of(names.COORDINATOR)[0].container
    health = next(p["containerPort"] for p in coordinator["ports"] if p["name"] == "health")
    assert coordinator["readinessProbe"]["grpc"]["port"] == coordinator["livenessProbe"]["grpc"]["port"] == health
    assert f"--health-port={health}" in coordinator["args"]
    assert f"--bootstrap-listen=$(POD_IP):{names.BOOTSTRAP_PORT}" in coordinator["args"]
    assert "--signing-ca-dir=/etc/pliant/signing" in coordinator["args"]
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        assert any(p.labels.items() >= pdb["spec"]["selector"]["matchLabels"].items() for p in cluster.pods)
    mounted = {
        v["secret"]["secretName"]
        for w in of_kind(docs, "StatefulSet") + of_kind(docs, "Deployment")
        for v in w["spec"]["template"]["spec"].get("volumes", [])
        if "secret" in v
    }
    made = render_secrets(ControlPlanePki.ensure(tmp_path / "pki"))
    assert mounted == {s["metadata"]["name"] for s in made} == CONTROL_PLANE_SECRETS, (
        "pliant k8s secrets makes every Secret the control plane mounts, and no admin key"
    )
    assert {s["metadata"]["namespace"] for s in made} == {names.NAMESPACE}
    jobs = _jobs(tmp_path)
    (agents,) = [j for j in of_kind(jobs["alpha"], "Job") if j["spec"].get("completionMode") == "Indexed"]
    args = agents["spec"]["template"]["spec"]["containers"][0]["args"]
    service = f"{names.COORDINATOR}.{names.NAMESPACE}.svc"  # a name the coordinators' certificate carries
    assert (
        f"--coordinator={service}:{names.API_PORT}" in args and f"--bootstrap={service}:{names.BOOTSTRAP_PORT}" in args
    )
    assert "--job=team-a.alpha" in args and "--create-job" in args and "--node-id=team-a.$(POD_NAME)" in args
    (agents,) = [j for j in of_kind(jobs["beta-2"], "Job") if j["spec"].get("completionMode") == "Indexed"]
    args = agents["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--job=team-b.beta-2" in args and "--create-job" not in args, "an admin created it: its own token"


def test_the_dockerfile_copies_what_exists_and_installs_the_package() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    assert 'pip install ".[torch,etcd]"' in text and "WORKDIR /app" in text


def test_dashboard_is_well_formed_and_filters_every_job_panel() -> None:
    board = json.loads((MONITORING / "grafana" / "pliant-dashboard.json").read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in board["panels"]}
    assert {
        "World size and members",
        "Generations",
        "Step time",
        "Throughput",
        "Checkpoint times",
        "Restarts and worker exits",
    } <= titles
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            if re.search(r"pliant_(worker|agent|job)_", expr):
                assert '$job_id"' in expr, f"{panel['title']}: not filtered by the dashboard's job: {expr}"


def test_env_expansion_uses_field_refs(tmp_path: Path) -> None:
    cluster = Cluster(load_manifests() + render_secrets(ControlPlanePki.ensure(tmp_path / "pki")), tmp_path, "etcd")
    for pod in cluster.pods:
        argv, _ = cluster.command(pod)
        assert not any("$(" in a for a in argv), argv
    pod = cluster.pods_of("pliant-coordinator")[1]
    argv, _ = cluster.command(pod)
    assert f"--listen={pod.ip}:29400" in argv and f"--replica-id={pod.name}" in argv


def _workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return of_kind(docs, "StatefulSet") + of_kind(docs, "Deployment") + of_kind(docs, "Job")


def test_every_pod_is_hardened(tmp_path: Path) -> None:
    """Non-root, no privilege escalation, read-only root filesystem, no capabilities, RuntimeDefault seccomp, CPU and
    memory requests and limits, images pinned by tag, no service-account token."""
    docs = load_manifests() + [o for objects in _jobs(tmp_path).values() for o in objects]
    for workload in _workloads(docs):
        name, pod = workload["metadata"]["name"], workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            res = container["resources"]
            assert {"cpu", "memory"} <= res["requests"].keys() and {"cpu", "memory"} <= res["limits"].keys(), name
            image = container["image"]
            assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image by tag, not {image}"
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert all(i["newTag"] != "latest" for i in kust["images"])


def test_every_object_carries_the_six_recommended_labels(tmp_path: Path) -> None:
    docs = load_manifests() + [o for objects in _jobs(tmp_path).values() for o in objects]
    docs += render_secrets(ControlPlanePki.ensure(tmp_path / "pki"))
    for doc in docs:
        assert doc["metadata"].get("labels", {}).keys() >= LABELS, f"{doc['kind']} {doc['metadata']['name']}"
    for workload in _workloads(docs):
        assert workload["spec"]["template"]["metadata"]["labels"].keys() >= LABELS, workload["metadata"]["name"]


def test_every_channel_is_tls_and_no_agent_needs_a_certificate_of_its_own(tmp_path: Path) -> None:
    docs = load_manifests()
    (etcd,) = [w for w in of_kind(docs, "StatefulSet") if w["metadata"]["name"] == "etcd"]
    args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag in (
        "--client-cert-auth",
        "--peer-client-cert-auth",
        "--cert-file=",
        "--peer-cert-file=",
        "--trusted-ca-file=",
        "--auto-compaction-retention=",
        "--quota-backend-bytes=",
    ):
        assert any(a.startswith(flag) for a in args), flag
    assert not any("http://" in a for a in args if not a.startswith("--listen-metrics-urls")), args
    quota = int(next(a for a in args if a.startswith("--quota-backend-bytes=")).split("=")[1])
    volume = etcd["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    assert volume.endswith("Gi") and quota < int(volume[:-2]) * 2**30, "etcd's quota must stay below its volume"
    coordinator = of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tls-dir=/etc/pliant/tls" in coordinator and not any(a == "--insecure" for a in coordinator)
    assert all(
        url.startswith("https://")
        for a in coordinator
        if a.startswith("--etcd=")
        for url in a.split("=", 1)[1].split(",")
    )
    for objects in _jobs(tmp_path).values():
        for workload in _workloads(objects):
            pod = workload["spec"]["template"]["spec"]
            container = pod["containers"][0]
            assert "--insecure" not in container["args"], workload["metadata"]["name"]
            assert not any("items" in v.get("secret", {}) for v in pod["volumes"]), "no per-pod certificate items"
        (agents,) = [w for w in of_kind(objects, "Job") if w["spec"].get("completionMode") == "Indexed"]
        pod = agents["spec"]["template"]["spec"]
        assert f"--ca-cert-hash={HASH}" in pod["containers"][0]["args"]
        assert not [v for v in pod["volumes"] if "secret" in v], "agents get their certificate by the bootstrap join"


def test_network_policies_close_every_component(tmp_path: Path) -> None:
    docs = load_manifests()
    policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(docs, "NetworkPolicy")}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    for component in ("etcd", "pliant-coordinator"):
        spec = policies[component]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == component

    def sources(spec: dict[str, Any], port: int) -> set[str]:
        """Who may reach ``port``: the app names, and the jobs where a rule names one."""
        return {
            "/".join(
                peer["podSelector"]["matchLabels"][k]
                for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")
                if k in peer["podSelector"]["matchLabels"]
            )
            for rule in spec["ingress"]
            if not rule.get("ports") or any(p["port"] == port for p in rule["ports"])
            for peer in rule["from"]
            if "podSelector" in peer
        }

    assert sources(policies["etcd"], 2379) == {"pliant-coordinator", "etcd"}
    assert sources(policies["pliant-coordinator"], names.API_PORT) == {"pliant-agent"}, "no admin pod in the cluster"
    assert sources(policies["pliant-coordinator"], names.BOOTSTRAP_PORT) == {"pliant-agent"}
    (agents,) = [r["from"][0] for r in policies["pliant-coordinator"]["ingress"] if "podSelector" in r["from"][0]]
    assert agents["namespaceSelector"] == {}, "agents of every job namespace reach the coordinators"
    for job, objects in _jobs(tmp_path).items():
        (policy,) = of_kind(objects, "NetworkPolicy")
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == job
        assert sources(policy["spec"], 12345) == {f"pliant-agent/{job}"}, "store and gloo ports: the job's pods only"


def test_two_jobs_side_by_side_share_no_name_or_selector(tmp_path: Path) -> None:
    jobs = _jobs(tmp_path)
    named = [{(o["kind"], o["metadata"]["name"]) for o in objects} for objects in jobs.values()]
    assert not named[0] & named[1]
    selected = [
        {tuple(sorted(w["spec"]["template"]["metadata"]["labels"].items())) for w in _workloads(objects)}
        for objects in jobs.values()
    ]
    assert not selected[0] & selected[1]
    for job, objects in jobs.items():
        for policy in of_kind(objects, "NetworkPolicy") + of_kind(objects, "PodDisruptionBudget"):
            matched = policy["spec"].get("podSelector", policy["spec"].get("selector"))["matchLabels"]
            assert matched["app.kubernetes.io/instance"] == job


def test_the_agents_job_completes_fails_and_replaces_by_exit_code(tmp_path: Path) -> None:
    """The pod failure policy reads the agent's exit codes; the grace covers a graceful leave's every stage."""
    (agents,) = [j for j in of_kind(_jobs(tmp_path)["beta-2"], "Job") if j["spec"].get("completionMode") == "Indexed"]
    spec = agents["spec"]
    assert spec["completions"] == spec["parallelism"] == 3
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    rules = {r["action"]: r["onExitCodes"]["values"] for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r}
    assert rules == {"FailJob": [ExitCode.JOB_FAILED], "Ignore": [left_on(2), left_on(15)]}
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] >= 120 + 5 + 10
    container = spec["template"]["spec"]["containers"][0]
    assert container["startupProbe"]["httpGet"]["path"] == container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["args"][-3:] == ["/opt/pliant/script/train.py", "--lr", "0.1"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoExecute"},
    ]
    assert "--checkpoint-dir=/checkpoints/beta-2" in container["args"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"job_id": "Big_Job"}, "job id 'Big_Job'"),
        ({"ca_cert_hash": "abc"}, "--ca-cert-hash 'abc'"),
        ({"min_nodes": 3, "max_nodes": 2}, "--nnodes 3:2"),
        ({"memory": "8 GB"}, "--memory '8 GB'"),
        ({"image": ""}, "--image is required"),
        ({"command": ()}, "no training script"),
        ({"nodes": 8, "max_nodes": 4}, "--nodes 8 is more than --nnodes 1:4 admits: 4 pods would wait as spares"),
        ({"nodes": 1, "min_nodes": 2, "max_nodes": 4}, "--nodes 1 is fewer than --nnodes 2:4 needs"),
        ({"gpus": 1, "nproc_per_node": 2}, "--gpus 1 with --nproc-per-node 2: each worker drives one GPU"),
        ({"namespace": "pliant"}, "--namespace pliant is the control plane's"),
        ({"namespace": "Team_A"}, "--namespace 'Team_A' is not a Kubernetes namespace's name"),
        ({"node_selector": ("gpu",)}, "--node-selector 'gpu' must be KEY=VALUE"),
        ({"tolerations": ("nvidia.com/gpu:Never",)}, "--toleration 'nvidia.com/gpu:Never' must be KEY[=VALUE]:EFFECT"),
    ],
)
def test_bad_parameters_name_the_flag_and_the_fix(change: dict[str, Any], named: str) -> None:
    base = {"job_id": "ok", "image": "i:1", "command": ("t.py",), "ca_cert_hash": HASH}
    with pytest.raises(ConfigError, match=re.escape(named)):
        JobUnit(**{**base, **change})


def test_the_secrets_command_is_idempotent_and_pins_its_ca(tmp_path: Path) -> None:
    first = render_secrets(ControlPlanePki.ensure(tmp_path / "pki"))
    pki = ControlPlanePki.ensure(tmp_path / "pki")
    assert render_secrets(pki) == first, "running it again makes nothing new"
    assert ca_fingerprint(pki.ca_cert.read_bytes()).startswith("sha256:")
    assert (tmp_path / "pki" / "ca.key").stat().st_mode & 0o077 == 0


def test_the_job_command_prints_the_manifests_or_one_line_naming_the_bad_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pliant.cli import main

    pki = ControlPlanePki.ensure(tmp_path / "pki")
    flags = ["k8s", "job", "--image=reg/pliant:1", f"--ca-cert={pki.ca_cert}", "--nnodes=1:4", "--nproc-per-node=2"]
    assert main([*flags, "--job=demo", "/app/train.py", "--lr", "0.1"]) == 0
    objects = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    (agents,) = [o for o in objects if o["kind"] == "Job" and o["spec"].get("completionMode") == "Indexed"]
    args = agents["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-3:] == ["/app/train.py", "--lr", "0.1"] and "--nnodes=1:4" in args and "--nproc-per-node=2" in args
    assert f"--ca-cert-hash={ca_fingerprint(pki.ca_cert.read_bytes())}" in args
    assert main([*flags, "--job=Demo", "/app/train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pliant k8s: error: job id 'Demo' must be a DNS label") and err.count("\n") == 1, err
    assert main([*flags[:-2], "--nnodes=4:1", "--job=demo", "/app/train.py"]) == 2
    assert "--nnodes '4:1' must have 1 <= MIN <= MAX" in capsys.readouterr().err


def _secret_references(obj: Any) -> set[str]:
    """Every Secret an object names: volumes (plain and projected), env and envFrom, image pull Secrets, and
    the resourceNames of any role it grants."""
    found: set[str] = set()
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("secret",) and isinstance(value, dict):
                found.add(value.get("secretName", value.get("name", "")))
            elif key in ("secretKeyRef", "secretRef") and isinstance(value, dict):
                found.add(value["name"])
            elif key == "imagePullSecrets":
                found |= {v["name"] for v in value}
            else:
                found |= _secret_references(value)
    elif isinstance(obj, list):
        for item in obj:
            found |= _secret_references(item)
    return found


def test_nothing_a_job_namespace_gets_touches_a_control_plane_secret(tmp_path: Path) -> None:
    """Every object rendered for a job lives in the job's namespace, is no RBAC grant, and names no Secret but its
    namespace's join token (or the token Secret of an admin-created job): no CA key, signing key or admin key."""
    units = _units(tmp_path)
    for job, objects in _jobs(tmp_path).items():
        unit = units[job]
        assert {o["metadata"]["namespace"] for o in objects} == {unit.namespace}
        assert not {o["kind"] for o in objects} & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Secret"}
        referenced = set().union(*(_secret_references(o) for o in objects))
        assert referenced == {unit.token_secret or names.JOIN_SECRET}, referenced
        assert not referenced & CONTROL_PLANE_SECRETS
    secret = join_secret("team-a", "t" * 43)
    assert (secret["metadata"]["namespace"], secret["metadata"]["name"]) == ("team-a", names.JOIN_SECRET)
    assert list(secret["stringData"]) == ["token"]


def test_the_same_flags_render_the_same_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rendering is pure: nothing random (no token) in a job's objects, so a second render, a GitOps re-render or a
    second `kubectl apply` changes nothing."""
    from pliant.cli import main

    pki = ControlPlanePki.ensure(tmp_path / "pki")
    flags = [
        "k8s",
        "job",
        "--namespace=team-a",
        "--job=demo",
        "--image=reg/pliant:1",
        f"--ca-cert={pki.ca_cert}",
        "--nnodes=1:4",
        "--nproc-per-node=2",
        "/app/train.py",
    ]
    outputs = []
    for _ in range(2):
        assert main(flags) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].count("kind:") >= 4
    for unit in _units(tmp_path).values():
        assert _dump(render_job(unit)) == _dump(render_job(unit))


def test_the_simulated_cluster_refuses_what_a_real_one_refuses(tmp_path: Path) -> None:
    """The tests' cluster (tests/integration/kubelet.py) keeps to what a real one enforces for these objects: a pod
    reads only its own namespace's Secrets, a claim binds only on a class with its access mode, and a NetworkPolicy
    that selects nothing is a mistake."""
    cluster = Cluster(load_manifests() + render_secrets(ControlPlanePki.ensure(tmp_path / "pki")), tmp_path, "etcd")
    cluster.add([join_secret("team-a", "t" * 43)])
    alpha = dataclasses.replace(_units(tmp_path)["alpha"], storage_class="nfs")

    def agents_pod(unit: JobUnit, edit: Any = None) -> Any:
        objects = render_job(unit)
        cluster.add(objects)  # an Indexed Job's pods are the controller's: made here
        (agents,) = of_kind(objects, "Job")
        template = copy.deepcopy(agents["spec"]["template"])
        if edit is not None:
            edit(template["spec"])
        return cluster.make_pod(f"{unit.name}-0", unit.name, unit.namespace, template, cluster.subnet())

    argv, env = cluster.command(agents_pod(alpha))
    assert env["PLIANT_JOIN_TOKEN"] == "t" * 43 and "--job=team-a.alpha" in argv
    elsewhere = agents_pod(dataclasses.replace(alpha, namespace="team-b"))
    with pytest.raises(Refused, match=r"names Secret pliant-join, which team-b has not \(only team-a has"):
        cluster.command(elsewhere)

    def mount_signing_key(spec: dict[str, Any]) -> None:
        spec["volumes"].append({"name": "ca", "secret": {"secretName": names.SIGNING_CA}})
        spec["containers"][0]["volumeMounts"].append({"name": "ca", "mountPath": "/ca"})

    with pytest.raises(Refused, match=r"names Secret pliant-signing-ca, which team-a has not \(only pliant has"):
        cluster.command(agents_pod(dataclasses.replace(alpha, job_id="delta"), mount_signing_key))
    with pytest.raises(Refused, match="ReadWriteMany of storage class standard, which binds ReadWriteOnce only"):
        cluster.add(render_job(dataclasses.replace(alpha, job_id="gamma", storage_class="")))
    (policy,) = of_kind(render_job(dataclasses.replace(alpha, job_id="epsilon")), "NetworkPolicy")
    with pytest.raises(Refused, match="NetworkPolicy team-a/pliant-epsilon-agents selects no pod"):
        cluster.add([policy])
