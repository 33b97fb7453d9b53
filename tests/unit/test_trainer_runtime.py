"""The Kubeflow Trainer runtime checked offline: the ClusterTrainingRuntime `pliant k8s trainer-runtime` renders and
the TrainJob example validate against Trainer's own CRD schemas (vendored under tests/schemas/kubeflow-trainer/),
with unknown fields refused as `kubectl apply --validate=strict` refuses them; the Job it stamps out per TrainJob
passes kubernetes-validate --strict at the minimum Kubernetes version and the newest; and it names no Secret but the
namespace's join token. Its pods run for real in tests/integration/test_deploy.py."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator

from pliant.errors import ConfigError
from pliant.k8s import names
from pliant.k8s.cli import _dump
from pliant.k8s.trainer import TrainerRuntime, render_trainer_runtime
from tests.integration.kubelet import ROOT
from tests.unit.test_deploy_manifests import _newest_kubernetes, _secret_references

SCHEMAS = ROOT / "tests" / "schemas" / "kubeflow-trainer"
EXAMPLE = ROOT / "examples" / "k8s" / "trainjob.yaml"
HASH = "sha256:" + "cd" * 32


def strict(schema: Any) -> Any:
    """A CRD's openAPIV3Schema as a JSON Schema that refuses fields it does not name (where it names its fields and
    keeps no unknown ones), as the API server's strict field validation does."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-"):
            continue
        if key == "properties":
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = strict(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [strict(sub) for sub in value]
        else:
            out[key] = value
    keeps_unknown = schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and "additionalProperties" not in schema and not keeps_unknown:
        out["additionalProperties"] = False
    return out


def _errors(kind: str, obj: dict[str, Any]) -> list[str]:
    vendored = json.loads((SCHEMAS / f"{kind}.json").read_text())
    group, version = obj["apiVersion"].split("/")
    assert (group, obj["kind"]) == (vendored["group"], kind)
    validator = Draft7Validator(strict(vendored["versions"][version]))
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj))


def _runtime() -> dict[str, Any]:
    return render_trainer_runtime(TrainerRuntime(image="reg/pliant:0.1.0", ca_cert_hash=HASH))


def test_the_runtime_and_the_trainjob_example_match_trainers_crd_schemas() -> None:
    runtime = _runtime()
    assert not _errors("ClusterTrainingRuntime", runtime)
    (trainjob,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    assert not _errors("TrainJob", trainjob)
    assert trainjob["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": runtime["metadata"]["name"],
    }
    assert "command" not in trainjob["spec"]["trainer"], "trainer.command would replace the agent"
    typo = copy.deepcopy(runtime)
    typo["spec"]["template"]["spec"]["replicatedJob"] = typo["spec"]["template"]["spec"].pop("replicatedJobs")
    assert _errors("ClusterTrainingRuntime", typo) == [
        "spec.template.spec: Additional properties are not allowed ('replicatedJob' was unexpected)"
    ]


@pytest.mark.parametrize("version", ["minimum", "newest"])
def test_the_job_each_trainjob_runs_passes_kubernetes_validate_strict(tmp_path: Path, version: str) -> None:
    (replicated,) = _runtime()["spec"]["template"]["spec"]["replicatedJobs"]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "elastic-mlp-node-0", "namespace": "team-a"}}
    job["spec"] = {**replicated["template"]["spec"], "completionMode": "Indexed", "completions": 4, "parallelism": 4}
    (tmp_path / "job.yaml").write_text(_dump([job]))
    tool = Path(sys.executable).with_name("kubernetes-validate")
    k = names.MIN_KUBERNETES if version == "minimum" else _newest_kubernetes()
    result = subprocess.run(
        [str(tool), "--strict", "-k", k, str(tmp_path / "job.yaml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_runtime_joins_by_the_namespaces_token_and_touches_no_control_plane_secret() -> None:
    runtime = _runtime()
    assert _secret_references(runtime) == {names.JOIN_SECRET}
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "node" and container["command"][:2] == ["pliant", "agent"]
    assert container["command"][-1] == "--", "the TrainJob's args follow: the script"
    command = container["command"]
    for flag in ("--job=$(POD_NAMESPACE).$(TRAINJOB_NAME)", "--create-job", "--nnodes=1:$(PET_NNODES)"):
        assert flag in command
    assert f"--coordinator={names.COORDINATOR}.{names.NAMESPACE}.svc:{names.API_PORT}" in command
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == names.CHECKPOINT_CLAIM
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"


def test_bad_runtime_parameters_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="--ca-cert-hash 'x'"):
        TrainerRuntime(image="i:1", ca_cert_hash="x")
    with pytest.raises(ConfigError, match="--image is required"):
        TrainerRuntime(image="", ca_cert_hash=HASH)
