"""A tiny local "kubelet" for tests: runs the containers of deploy/*.yaml as local processes, exactly as written.

Each pod of a Deployment or StatefulSet gets its own loopback address (127.0.K.N), so every pod can bind the ports its
manifest names. Kubernetes semantics kept: ``env`` values and ``fieldRef`` (metadata.name, status.podIP), ``$(VAR)``
expansion in command and args, StatefulSet pod names ``<set>-<i>``. What a cluster would provide is mapped:

- DNS (in HOST:PORT): ``<pod>.<headless service>`` resolves to that pod's address, ``<service>`` to the first pod
  it selects;
- the image: ``/app`` is the repository, ``pliant`` the installed console script, ``etcd`` the etcd binary;
- volumes: each mount path becomes a directory under the test's temporary directory (per pod, or shared for a PVC);
  a Secret volume is filled from the test's ``secrets`` (its ``items`` mapping, ``optional`` keys skipped), and
  ``subPathExpr`` picks the pod's own subdirectory; ``secretKeyRef`` env values come from the same secrets;
- a Job is one pod, run to completion by the test.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def load_manifests(directory: Path = DEPLOY) -> list[dict[str, Any]]:
    """Every Kubernetes object in ``directory``'s YAML files (the kustomization itself excluded)."""
    docs = []
    for path in sorted(directory.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def selects(service: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@dataclass
class Pod:
    """One pod's single container, ready to run."""

    name: str
    ip: str
    workload: str
    labels: dict[str, str]
    container: dict[str, Any]
    volumes: dict[str, Path] = field(default_factory=dict)  # mount path -> local directory
    secret_mounts: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)  # (mount, secret source)

    def port(self, name: str) -> int:
        return next(int(p["containerPort"]) for p in self.container.get("ports", []) if p.get("name") == name)


class Cluster:
    """The pods of ``docs``, their addresses and names, and how to turn a container into a local command.

    Args:
        docs: the manifests.
        workdir: where volumes live.
        etcd_binary: the local etcd executable.
        secrets: Secret name -> key -> bytes (what ``kubectl create secret`` would hold).
    """

    def __init__(
        self,
        docs: list[dict[str, Any]],
        workdir: Path,
        etcd_binary: str,
        secrets: dict[str, dict[str, bytes]] | None = None,
    ) -> None:
        self.docs = docs
        self.workdir = workdir
        self.secrets = secrets or {}
        self.executables = {"pliant": str(Path(sys.executable).with_name("pliant")), "etcd": etcd_binary}
        self.pods: list[Pod] = []
        claims = {
            c["metadata"]["name"]: workdir / "pvc" / c["metadata"]["name"]
            for c in of_kind(docs, "PersistentVolumeClaim")
        }
        workloads = of_kind(docs, "StatefulSet") + of_kind(docs, "Deployment") + of_kind(docs, "Job")
        for k, workload in enumerate(workloads, start=1):
            name, spec = workload["metadata"]["name"], workload["spec"]
            template = spec["template"]
            (container,) = template["spec"]["containers"]
            for i in range(spec.get("replicas", 1)):
                pod_name = f"{name}-{i}" if workload["kind"] == "StatefulSet" else f"{name}-{i:05d}"
                pod = Pod(pod_name, f"127.0.{k}.{i + 1}", name, template["metadata"]["labels"], container)
                volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
                for mount in container.get("volumeMounts", []):
                    source = volumes.get(mount["name"], {})
                    claim = source.get("persistentVolumeClaim")
                    local = claims[claim["claimName"]] if claim else workdir / "pods" / pod_name / mount["name"]
                    local.mkdir(parents=True, exist_ok=True)
                    pod.volumes[mount["mountPath"]] = local
                    if "secret" in source:
                        pod.secret_mounts.append((mount, source["secret"]))
                self.pods.append(pod)
        self.names: dict[str, str] = {}
        for service in of_kind(docs, "Service"):
            selected = [p for p in self.pods if selects(service, p.labels)]
            if not selected:
                continue
            self.names[service["metadata"]["name"]] = selected[0].ip
            if service["spec"].get("clusterIP") == "None":
                for pod in selected:
                    self.names[f"{pod.name}.{service['metadata']['name']}"] = pod.ip

    def pods_of(self, workload: str) -> list[Pod]:
        return [p for p in self.pods if p.workload == workload]

    def _resolve(self, text: str) -> str:
        for name in sorted(self.names, key=len, reverse=True):  # longest first: etcd-0.etcd before etcd
            text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?=:\d)", self.names[name], text)  # HOST:PORT only
        return text

    def _paths(self, pod: Pod, text: str) -> str:
        """Mount paths (longest first, in one pass: a local path is never mapped again) and /app/ mapped locally."""
        mounts = {**{m: str(local) for m, local in pod.volumes.items()}, "/app": str(ROOT)}
        pattern = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
        return re.sub(rf"(?<![\w.-])({pattern})(?=/|$|[^\w.-])", lambda m: mounts[m.group(1)], text)

    def _secret(self, name: str, key: str) -> bytes | None:
        return self.secrets.get(name, {}).get(key)

    def _fill_secret_volumes(self, pod: Pod, env: dict[str, str]) -> None:
        """Write each Secret volume's files (its items, or every key) and point the mount at its subPathExpr."""
        for mount, source in pod.secret_mounts:
            volume = self.workdir / "pods" / pod.name / f"secret-{mount['name']}"
            items = source.get("items") or [{"key": k, "path": k} for k in self.secrets.get(source["secretName"], {})]
            for item in items:
                data = self._secret(source["secretName"], item["key"])
                if data is None:
                    if source.get("optional"):
                        continue
                    raise KeyError(f"secret {source['secretName']} has no key {item['key']}")
                target = volume / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            expr = mount.get("subPathExpr", mount.get("subPath", ""))
            sub = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), expr)
            pod.volumes[mount["mountPath"]] = volume / sub if sub else volume

    def command(self, pod: Pod) -> tuple[list[str], dict[str, str]]:
        """The pod's argv and environment, as the container would get them (names and paths mapped)."""
        env: dict[str, str] = {}
        for var in pod.container.get("env", []):
            if "value" in var:
                env[var["name"]] = str(var["value"])
                continue
            ref = var["valueFrom"]
            if "secretKeyRef" in ref:
                data = self._secret(ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
                if data is not None:
                    env[var["name"]] = data.decode()
                continue
            path = ref["fieldRef"]["fieldPath"]
            env[var["name"]] = {"metadata.name": pod.name, "status.podIP": pod.ip}[path]
        self._fill_secret_volumes(pod, env)

        def expand(text: str) -> str:
            return self._paths(pod, self._resolve(_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)))

        argv = [expand(a) for a in [*pod.container.get("command", []), *pod.container.get("args", [])]]
        argv[0] = self.executables.get(argv[0]) or shutil.which(argv[0]) or argv[0]
        return argv, env
