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
    assert coordinator["readinessProbe"]["grpc"]["port"] == coordinator["livenessProbe"]["grpc"]["port"] == 29400
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
    assert {"World size and members", "Generations", "Step time", "Throughput", "Checkpoint times",
            "Restarts and worker exits"} <= titles  # fmt: skip
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
