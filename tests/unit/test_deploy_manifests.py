"""deploy/ checked offline: every manifest valid under kubernetes-validate --strict (the operator's ServiceMonitor and
PrometheusRule against their own schemas, unknown fields refused), the kustomization complete, the wiring consistent
(probes, ports, services, the Dockerfile's sources), the dashboard well-formed. The running checks (containers as
written, a real Prometheus, promtool) are in tests/integration/test_deploy.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.integration.kubelet import DEPLOY, ROOT, Cluster, load_manifests, of_kind, selects

K8S_FILES = sorted(p for p in DEPLOY.glob("*.yaml") if p.name not in ("kustomization.yaml", "monitoring.yaml"))


def test_core_manifests_pass_kubernetes_validate_strict() -> None:
    tool = Path(sys.executable).with_name("kubernetes-validate")
    result = subprocess.run([str(tool), "--strict", *map(str, K8S_FILES)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = re.findall(r"passed for resource (\S+)", result.stdout + result.stderr)
    kinds = {r.split("/")[0] for r in passed}
    assert {"statefulset", "deployment", "service", "poddisruptionbudget", "persistentvolumeclaim"} <= kinds


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

    docs = [d for d in yaml.safe_load_all((DEPLOY / "monitoring.yaml").read_text()) if d]
    assert sorted(d["kind"] for d in docs) == ["PrometheusRule", "ServiceMonitor"]
    for doc in docs:
        model = getattr(v1, doc["kind"]).model_validate(doc)
        dumped = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
        assert not _unknown_fields(doc, dumped), f"{doc['kind']}: fields unknown to its CRD"
    bad = json.loads(json.dumps(docs[0]))
    bad["spec"]["endpoints"][0]["prot"] = "metrics"
    parsed = getattr(v1, bad["kind"]).model_validate(bad).model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert _unknown_fields(bad, parsed) == [".spec.endpoints[0].prot"]


def test_kustomization_lists_every_manifest_and_the_dashboard() -> None:
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    (generator,) = kust["configMapGenerator"]
    assert all((DEPLOY / f).is_file() for f in generator["files"])


def test_wiring_is_consistent(tmp_path: Path) -> None:
    docs = load_manifests()
    cluster = Cluster(docs, tmp_path, "etcd")
    assert [len(cluster.pods_of(w)) for w in ("etcd", "pliant-coordinator", "pliant-agent")] == [3, 2, 2]
    for service in of_kind(docs, "Service"):  # every Service selects pods that declare its ports
        pods = [p for p in cluster.pods if selects(service, p.labels)]
        assert pods, service["metadata"]["name"]
        declared = {p["name"] for p in pods[0].container["ports"]}
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["name"]) in declared | {port["port"]}, (service["metadata"], port)
    coordinator = cluster.pods_of("pliant-coordinator")[0].container
    health = next(p["containerPort"] for p in coordinator["ports"] if p["name"] == "health")
    assert coordinator["readinessProbe"]["grpc"]["port"] == coordinator["livenessProbe"]["grpc"]["port"] == health
    assert f"--health-port={health}" in coordinator["args"]
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        assert any(p.labels.items() >= pdb["spec"]["selector"]["matchLabels"].items() for p in cluster.pods)
    argv, env = cluster.command(cluster.pods_of("pliant-agent")[1])
    assert "--node-id=pliant-agent-1" in argv and f"--host={cluster.pods_of('pliant-agent')[1].ip}" in argv
    assert f"--coordinator={cluster.pods_of('pliant-coordinator')[0].ip}:29400" in argv
    assert f"{ROOT}/examples/train_elastic.py" in argv
    assert env["POD_NAME"] == "pliant-agent-1"


def test_dockerfile_copies_what_exists_and_installs_the_package() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    assert 'pip install ".[torch,etcd]"' in text and "WORKDIR /app" in text


def test_dashboard_is_well_formed() -> None:
    board = json.loads((DEPLOY / "grafana" / "pliant-dashboard.json").read_text())
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
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_env_expansion_uses_field_refs(tmp_path: Path) -> None:
    cluster = Cluster(load_manifests(), tmp_path, "etcd")
    for pod in cluster.pods:
        argv, _ = cluster.command(pod)
        assert not any("$(" in a for a in argv), argv
    pod = cluster.pods_of("pliant-coordinator")[1]
    argv, _ = cluster.command(pod)
    assert f"--listen={pod.ip}:29400" in argv and f"--replica-id={pod.name}" in argv


def _workloads() -> list[dict[str, Any]]:
    docs = load_manifests()
    return of_kind(docs, "StatefulSet") + of_kind(docs, "Deployment") + of_kind(docs, "Job")


def test_every_pod_is_hardened() -> None:
    """Non-root, no privilege escalation, read-only root filesystem, no capabilities, RuntimeDefault seccomp, CPU and
    memory requests and limits, images pinned by tag, no service-account token."""
    for workload in _workloads():
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


def test_every_channel_is_tls_with_client_certificates() -> None:
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
    for name in ("pliant-agent", "pliant-create-job"):
        (workload,) = [w for w in _workloads() if w["metadata"]["name"] == name]
        container = workload["spec"]["template"]["spec"]["containers"][0]
        assert any(a.startswith("--tls-dir=") for a in container["args"]), name
        assert "--insecure" not in container["args"], name


def test_network_policies_close_every_component() -> None:
    docs = load_manifests()
    policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(docs, "NetworkPolicy")}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    for component in ("etcd", "pliant-coordinator", "pliant-agent"):
        spec = policies[component]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == component
    sources = lambda spec, port: {  # noqa: E731 - who may reach ``port``
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        for rule in spec["ingress"]
        if not rule.get("ports") or any(p["port"] == port for p in rule["ports"])
        for peer in rule["from"]
        if "podSelector" in peer
    }
    assert sources(policies["etcd"], 2379) == {"pliant-coordinator", "etcd"}
    assert sources(policies["pliant-coordinator"], 29400) == {"pliant-agent", "pliant-admin"}
    assert sources(policies["pliant-agent"], 12345) == {"pliant-agent"}, "store and gloo ports: the job's pods only"
