"""A tiny local "kubelet" and Job controller for tests: runs the containers of Kubernetes manifests as local processes,
exactly as written.

Each pod gets its own loopback address (127.W.K.N: W per pytest-xdist worker, K per workload), so every pod can bind the
ports its manifest names, and two workers' clusters never meet. Kubernetes
semantics kept: namespaces (an object without one takes the kustomization's, as ``kubectl apply -k`` gives it),
``env`` values, ``fieldRef`` (metadata.name, metadata.namespace, status.podIP) and ``secretKeyRef``, ``$(VAR)``
expansion in command and args, StatefulSet pod names ``<set>-<i>``. What a cluster would provide is mapped:

- DNS (in HOST:PORT): ``<service>.<namespace>.svc`` (and ``.svc.cluster.local``) resolves to the first pod the
  service selects from anywhere; ``<service>`` and ``<pod>.<headless service>`` only from the service's namespace;
- the image: ``/app`` is the repository, ``pliant`` the installed console script, ``etcd`` the etcd binary;
- volumes: each mount path becomes a directory under the test's temporary directory (per pod, or shared for a PVC);
  a Secret volume is filled from the Secrets of the pod's namespace (its ``items`` mapping, ``optional`` keys
  skipped; ``subPathExpr`` picks the pod's own subdirectory), a ConfigMap volume from its namespace's ConfigMaps;
- a plain Job is one pod, run to completion by the test; an Indexed Job is run by :class:`IndexedJob`, which keeps
  the Job controller's rules for it: a pod per index below ``completions`` (named ``<job>-<index>-<suffix>``, with
  ``JOB_COMPLETION_INDEX``), ``restartPolicy: Never``, the pod failure policy on exit codes, ``backoffLimit``,
  elastic scaling by patching ``parallelism`` and ``completions`` together, a deleted pod's SIGTERM to its PID 1 and
  SIGKILL after its ``terminationGracePeriodSeconds``, and the Job's Complete / Failed condition.

What a real cluster refuses, or leaves stuck, is refused here with :class:`Refused` naming the object: a pod that
names a Secret or ConfigMap its namespace does not have (a kubelet leaves it in CreateContainerConfigError or
ContainerCreating: a pod can never mount another namespace's Secret), a claim whose storage class cannot bind its
access mode (Pending forever; the cluster's classes are :data:`STORAGE_CLASSES`, ``standard`` the default), and a
NetworkPolicy whose pod selector matches no pod of its namespace's workloads (accepted by a real API server, and
silently useless).

A TrainJob on a pliant ClusterTrainingRuntime becomes the Indexed Job Kubeflow Trainer would make of it
(:func:`trainjob_job`), which :class:`IndexedJob` runs.

Not kept: scheduling, resources, probes (the tests call the probe endpoints themselves), the NetworkPolicies' traffic
rules, and the ``DisruptionTarget`` condition (a deletion here is a user's ``kubectl delete pod``).
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets as random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
STORAGE_CLASSES = {"standard": ("ReadWriteOnce",), "nfs": ("ReadWriteMany", "ReadWriteOnce")}
DEFAULT_STORAGE_CLASS = "standard"  # as on most managed clusters: block volumes, one node at a time


class Refused(Exception):
    """What a real cluster would refuse or leave stuck (see the module docstring)."""


def load_manifests(directory: Path = DEPLOY) -> list[dict[str, Any]]:
    """Every Kubernetes object of the kustomization in ``directory`` (its resources, in its namespace)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        for doc in parse_manifests((directory / name).read_text()):
            if doc["kind"] != "Namespace":
                doc["metadata"].setdefault("namespace", kustomization["namespace"])
            docs.append(doc)
    return docs


def parse_manifests(text: str) -> list[dict[str, Any]]:
    """The objects of a multi-document YAML text (what ``kubectl apply -f -`` reads)."""
    return [d for d in yaml.safe_load_all(text) if d]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def selects(service: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def is_indexed(workload: dict[str, Any]) -> bool:
    return workload["kind"] == "Job" and workload["spec"].get("completionMode") == "Indexed"


def secret_data(secret: dict[str, Any]) -> dict[str, bytes]:
    """A Secret object's keys and bytes (``data`` is base64, ``stringData`` plain)."""
    out = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    out.update({k: str(v).encode() for k, v in (secret.get("stringData") or {}).items()})
    return out


@dataclass
class Pod:
    """One pod's single container, ready to run."""

    name: str
    ip: str
    workload: str
    namespace: str
    labels: dict[str, str]
    container: dict[str, Any]
    spec: dict[str, Any] = field(default_factory=dict)  # the pod template's spec
    extra_env: dict[str, str] = field(default_factory=dict)  # what the controller adds (JOB_COMPLETION_INDEX)
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
    """

    def __init__(self, docs: list[dict[str, Any]], workdir: Path, etcd_binary: str) -> None:
        self.docs: list[dict[str, Any]] = []
        self.workdir = workdir
        self.secrets: dict[tuple[str, str], dict[str, bytes]] = {}  # (namespace, name) -> key -> bytes
        self.config_maps: dict[tuple[str, str], dict[str, str]] = {}
        self.claims: dict[tuple[str, str], Path] = {}
        self.executables = {"pliant": str(Path(sys.executable).with_name("pliant")), "etcd": etcd_binary}
        self.pods: list[Pod] = []
        self.names: dict[str, str] = {}  # names every pod resolves: <service>.<namespace>.svc[.cluster.local]
        self.local_names: dict[str, dict[str, str]] = {}  # namespace -> names its pods resolve: <service>, <pod>.<svc>
        self._subnets = 0
        self._hosts: dict[int, int] = {}
        self._octet = 10 + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
        self.add(docs)

    def add(self, docs: list[dict[str, Any]]) -> list[Pod]:
        """Take in more objects (``kubectl apply``): their Secrets, ConfigMaps and claims, and the pods of their
        StatefulSets, Deployments and plain Jobs (returned); an Indexed Job's pods are :class:`IndexedJob`'s.

        Raises:
            Refused: a claim its storage class cannot bind, or a NetworkPolicy that selects no pod.
        """
        self.docs += docs
        for secret in of_kind(docs, "Secret"):
            self.secrets[_key(secret)] = secret_data(secret)
        for config_map in of_kind(docs, "ConfigMap"):
            self.config_maps[_key(config_map)] = dict(config_map.get("data") or {})
        for claim in of_kind(docs, "PersistentVolumeClaim"):
            _check_binds(claim)
            self.claims[_key(claim)] = self.workdir / "pvc" / "/".join(_key(claim))
        for policy in of_kind(docs, "NetworkPolicy"):
            self._check_selects(policy)
        added = []
        for workload in of_kind(docs, "StatefulSet") + of_kind(docs, "Deployment") + of_kind(docs, "Job"):
            if is_indexed(workload):
                continue
            name, spec = workload["metadata"]["name"], workload["spec"]
            for template in workload["spec"].get("volumeClaimTemplates", []):
                _check_binds(template)
            subnet = self.subnet()
            for i in range(spec.get("replicas", 1)):
                pod_name = f"{name}-{i}" if workload["kind"] == "StatefulSet" else f"{name}-{i:05d}"
                added.append(self.make_pod(pod_name, name, _namespace(workload), spec["template"], subnet))
        for service in of_kind(self.docs, "Service"):
            namespace = _namespace(service)
            selected = [p for p in self.pods if p.namespace == namespace and selects(service, p.labels)]
            if not selected:
                continue
            name = service["metadata"]["name"]
            local = self.local_names.setdefault(namespace, {})
            local[name] = self.names[f"{name}.{namespace}.svc"] = selected[0].ip
            self.names[f"{name}.{namespace}.svc.cluster.local"] = selected[0].ip
            if service["spec"].get("clusterIP") == "None":
                for pod in selected:
                    local[f"{pod.name}.{name}"] = pod.ip
        return added

    def _check_selects(self, policy: dict[str, Any]) -> None:
        """Refuse a NetworkPolicy whose pod selector matches no pod template of its namespace's workloads."""
        wanted = policy["spec"]["podSelector"].get("matchLabels", {})
        if not wanted:
            return  # {}: every pod of the namespace
        namespace = _namespace(policy)
        templates = [
            w["spec"]["template"]["metadata"]["labels"]
            for w in of_kind(self.docs, "StatefulSet") + of_kind(self.docs, "Deployment") + of_kind(self.docs, "Job")
            if _namespace(w) == namespace
        ]
        if not any(labels.items() >= wanted.items() for labels in templates):
            raise Refused(
                f"NetworkPolicy {namespace}/{policy['metadata']['name']} selects no pod: no workload in {namespace} "
                f"has the labels {wanted}"
            )

    def subnet(self) -> int:
        """A new workload's address block: its pods are 127.W.K.N."""
        self._subnets += 1
        self._hosts[self._subnets] = 0
        return self._subnets

    def make_pod(
        self,
        name: str,
        workload: str,
        namespace: str,
        template: dict[str, Any],
        subnet: int,
        extra_env: dict[str, str] | None = None,
    ) -> Pod:
        """A pod of ``template`` named ``name`` with the next address of ``subnet``, its volumes made.

        Raises:
            Refused: it mounts a claim or ConfigMap its namespace does not have.
        """
        self._hosts[subnet] += 1
        (container,) = template["spec"]["containers"]
        pod = Pod(
            name,
            f"127.{self._octet}.{subnet}.{self._hosts[subnet]}",
            workload,
            namespace,
            dict(template["metadata"]["labels"]),
            container,
            template["spec"],
            dict(extra_env or {}),
        )
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            source = volumes.get(mount["name"], {})
            claim = source.get("persistentVolumeClaim")
            if claim and (namespace, claim["claimName"]) not in self.claims:
                raise Refused(f"pod {namespace}/{name} mounts claim {claim['claimName']}, which {namespace} has not")
            local = (
                self.claims[namespace, claim["claimName"]] if claim else self.workdir / "pods" / name / mount["name"]
            )
            local.mkdir(parents=True, exist_ok=True)
            pod.volumes[mount["mountPath"]] = local
            if "secret" in source:
                pod.secret_mounts.append((mount, source["secret"]))
            if "configMap" in source:
                config_map = self.config_maps.get((namespace, source["configMap"]["name"]))
                if config_map is None:
                    raise Refused(
                        f"pod {namespace}/{name} mounts ConfigMap {source['configMap']['name']}, which "
                        f"{namespace} has not"
                    )
                for key, text in config_map.items():
                    (local / key).write_text(text)
        self.pods.append(pod)
        return pod

    def pods_of(self, workload: str) -> list[Pod]:
        return [p for p in self.pods if p.workload == workload]

    def _resolve(self, pod: Pod, text: str) -> str:
        names = {**self.names, **self.local_names.get(pod.namespace, {})}
        for name in sorted(names, key=len, reverse=True):  # longest first: etcd-0.etcd before etcd
            text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?=:\d)", names[name], text)  # HOST:PORT only
        return text

    def _paths(self, pod: Pod, text: str) -> str:
        """Mount paths (longest first, in one pass: a local path is never mapped again) and /app/ mapped locally."""
        mounts = {**{m: str(local) for m, local in pod.volumes.items()}, "/app": str(ROOT)}
        pattern = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
        return re.sub(rf"(?<![\w.-])({pattern})(?=/|$|[^\w.-])", lambda m: mounts[m.group(1)], text)

    def _secret(self, pod: Pod, name: str) -> dict[str, bytes]:
        """Secret ``name`` of the pod's namespace (a pod sees no other namespace's).

        Raises:
            Refused: the namespace has no such Secret.
        """
        secret = self.secrets.get((pod.namespace, name))
        if secret is None:
            elsewhere = sorted(ns for ns, n in self.secrets if n == name)
            raise Refused(
                f"pod {pod.namespace}/{pod.name} names Secret {name}, which {pod.namespace} has not"
                + (f" (only {', '.join(elsewhere)} has: a pod reads its own namespace's Secrets)" if elsewhere else "")
            )
        return secret

    def _fill_secret_volumes(self, pod: Pod, env: dict[str, str]) -> None:
        """Write each Secret volume's files (its items, or every key) and point the mount at its subPathExpr."""
        for mount, source in pod.secret_mounts:
            volume = self.workdir / "pods" / pod.name / f"secret-{mount['name']}"
            secret = self._secret(pod, source["secretName"])
            items = source.get("items") or [{"key": k, "path": k} for k in secret]
            for item in items:
                data = secret.get(item["key"])
                if data is None:
                    if source.get("optional"):
                        continue
                    raise Refused(f"Secret {pod.namespace}/{source['secretName']} has no key {item['key']}")
                target = volume / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            expr = mount.get("subPathExpr", mount.get("subPath", ""))
            sub = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), expr)
            pod.volumes[mount["mountPath"]] = volume / sub if sub else volume

    def command(self, pod: Pod) -> tuple[list[str], dict[str, str]]:
        """The pod's argv and environment, as the container would get them (names and paths mapped).

        Raises:
            Refused: it names a Secret (or a key of one) its namespace has not.
        """
        env: dict[str, str] = dict(pod.extra_env)
        for var in pod.container.get("env", []):
            if "value" in var:
                env[var["name"]] = str(var["value"])
                continue
            ref = var["valueFrom"]
            if "secretKeyRef" in ref:
                data = self._secret(pod, ref["secretKeyRef"]["name"]).get(ref["secretKeyRef"]["key"])
                if data is None:
                    raise Refused(
                        f"Secret {pod.namespace}/{ref['secretKeyRef']['name']} has no key {ref['secretKeyRef']['key']}"
                    )
                env[var["name"]] = data.decode()
                continue
            path = ref["fieldRef"]["fieldPath"]
            fields = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "status.podIP": pod.ip}
            fields |= {f"metadata.labels['{k}']": v for k, v in pod.labels.items()}
            env[var["name"]] = fields[path]
        self._fill_secret_volumes(pod, env)

        def expand(text: str) -> str:
            return self._paths(pod, self._resolve(pod, _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)))

        argv = [expand(a) for a in [*pod.container.get("command", []), *pod.container.get("args", [])]]
        argv[0] = self.executables.get(argv[0]) or shutil.which(argv[0]) or argv[0]
        return argv, env


def trainjob_job(runtime: dict[str, Any], trainjob: dict[str, Any]) -> dict[str, Any]:
    """The Indexed Job Kubeflow Trainer makes of a TrainJob on a ClusterTrainingRuntime with one replicated job and
    the torch policy, as far as a pliant runtime depends on it: the runtime's Job template in the TrainJob's namespace,
    ``numNodes`` pods (parallelism and completions), the TrainJob's ``args``, ``env`` and ``resourcesPerNode`` on the
    container ``node``, ``PET_NNODES`` and ``PET_NPROC_PER_NODE`` injected there, and the JobSet's name label on every
    pod. (JobSet's own restarts of a failed child Job are not kept: a failed Job here fails the TrainJob.)"""
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    trainer = trainjob["spec"]["trainer"]
    name, namespace = trainjob["metadata"]["name"], _namespace(trainjob)
    nodes = int(trainer.get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"]))
    spec = {**replicated["template"]["spec"], "completionMode": "Indexed", "completions": nodes, "parallelism": nodes}
    template = spec["template"] = {**spec["template"]}
    template["metadata"] = {"labels": {**template["metadata"]["labels"], "jobset.sigs.k8s.io/jobset-name": name}}
    pod = template["spec"] = {**template["spec"]}
    (container,) = pod["containers"]
    container = {**container, "args": list(trainer.get("args", container.get("args", [])))}
    pet = [
        {"name": "PET_NNODES", "value": str(nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(trainer.get("numProcPerNode", 1))},
    ]
    container["env"] = [*container.get("env", []), *trainer.get("env", []), *pet]
    if "resourcesPerNode" in trainer:
        container["resources"] = trainer["resourcesPerNode"]
    pod["containers"] = [container]
    metadata = {"name": f"{name}-{replicated['name']}-0", "namespace": namespace}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


def _namespace(obj: dict[str, Any]) -> str:
    return obj["metadata"].get("namespace", "default")


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return _namespace(obj), obj["metadata"]["name"]


def _check_binds(claim: dict[str, Any]) -> None:
    """Refuse a claim that its storage class (or the default) cannot bind: Pending forever on a real cluster."""
    spec = claim["spec"]
    klass = spec.get("storageClassName") or DEFAULT_STORAGE_CLASS
    modes = STORAGE_CLASSES.get(klass)
    if modes is None:
        raise Refused(f"claim {claim['metadata']['name']} asks for storage class {klass}, which the cluster has not")
    missing = [m for m in spec["accessModes"] if m not in modes]
    if missing:
        raise Refused(
            f"claim {claim['metadata']['name']} asks for {', '.join(missing)} of storage class {klass}, which binds "
            f"{', '.join(modes)} only: it would stay Pending"
        )


@dataclass
class _Running:
    pod: Pod
    index: int
    process: Any
    deleted_at: float | None = None  # SIGTERM sent; SIGKILL after the grace


class IndexedJob:
    """The Job controller's rules for one elastic Indexed Job (see the module docstring), on a thread of its own.

    Threads: the controller thread runs :meth:`_reconcile`; the test calls :meth:`patch`, :meth:`delete_pod` and reads
    the state; ``_lock`` guards every field.

    Args:
        cluster: where its pods get addresses and volumes.
        job: the Job object.
        start: starts a pod's process and returns it (``proc``: its ``subprocess.Popen``; ``pid``).
    """

    def __init__(self, cluster: Cluster, job: dict[str, Any], start: Callable[[Pod], Any]) -> None:
        self.cluster, self.job, self._start = cluster, job, start
        self.name = job["metadata"]["name"]
        spec = job["spec"]
        self.completions = int(spec["completions"])
        self.parallelism = int(spec["parallelism"])
        self.backoff_limit = int(spec.get("backoffLimit", 6))
        self.rules = spec.get("podFailurePolicy", {}).get("rules", [])
        self.grace_s = float(spec["template"]["spec"].get("terminationGracePeriodSeconds", 30))
        self.subnet = cluster.subnet()
        self.running: list[_Running] = []
        self.succeeded: set[int] = set()
        self.failed_pods = 0
        self.exits: list[tuple[str, int, int]] = []  # (pod, index, exit code) of every pod that ended
        self.condition = ""  # "Complete" or "Failed"
        self.refused = ""  # why its pods cannot start (Refused): they stay stuck, as on a real cluster
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"job-{self.name}", daemon=True)
        self._thread.start()

    def patch(self, parallelism: int, completions: int) -> None:
        """``kubectl patch job NAME -p '{"spec":{"parallelism":P,"completions":C}}'`` (an elastic Indexed Job
        changes both together)."""
        with self._lock:
            assert parallelism == completions, "an elastic Indexed Job changes parallelism and completions together"
            self.parallelism, self.completions = parallelism, completions

    def delete_pod(self, name: str) -> None:
        """``kubectl delete pod NAME``: SIGTERM to its PID 1 now, SIGKILL after the grace."""
        with self._lock:
            for running in self.running:
                if running.pod.name == name and running.deleted_at is None:
                    self._terminate(running)

    def pods(self) -> list[Pod]:
        """The pods running now, by index."""
        with self._lock:
            return [r.pod for r in sorted(self.running, key=lambda r: r.index)]

    def process(self, name: str) -> Any:
        with self._lock:
            return next(r.process for r in self.running if r.pod.name == name)

    def close(self) -> None:
        """Stop the controller and SIGKILL every pod."""
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            for running in self.running:
                _kill_group(running.process.pid, signal.SIGKILL)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                self._reconcile(time.monotonic())

    def _terminate(self, running: _Running) -> None:
        running.deleted_at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(running.process.pid, signal.SIGTERM)  # the container's PID 1 only, as the kubelet does

    def _action(self, code: int) -> str:
        """The pod failure policy's action for a container that exited ``code`` (the first rule that matches)."""
        for rule in self.rules:
            on = rule.get("onExitCodes")
            if on is None:
                continue
            matched = code in on["values"]
            if matched == (on["operator"] == "In"):
                return rule["action"]
        return "Count"

    def _reconcile(self, now: float) -> None:
        if self.condition or self.refused:
            return
        for running in list(self.running):
            code = running.process.proc.poll()
            if code is None:
                if running.deleted_at is not None and now - running.deleted_at > self.grace_s:
                    _kill_group(running.process.pid, signal.SIGKILL)
                continue
            self.running.remove(running)
            self.exits.append((running.pod.name, running.index, code))
            if code == 0:
                self.succeeded.add(running.index)
                continue
            action = self._action(code)
            if action == "FailJob":
                self._fail()
                return
            if action == "Count":
                self.failed_pods += 1
                if self.failed_pods > self.backoff_limit:
                    self._fail()
                    return
        wanted = set(range(self.completions))
        for running in self.running:
            if running.index not in wanted and running.deleted_at is None:
                self._terminate(running)  # scaled down: the highest indexes go
        if wanted <= self.succeeded:
            self.condition = "Complete"
            for running in self.running:
                if running.deleted_at is None:
                    self._terminate(running)
            return
        busy = {r.index for r in self.running}
        for index in sorted(wanted - self.succeeded - busy):
            if len([r for r in self.running if r.deleted_at is None]) >= self.parallelism:
                break
            name = f"{self.name}-{index}-{random.token_hex(3)[:5]}"
            env = {"JOB_COMPLETION_INDEX": str(index)}
            template = self.job["spec"]["template"]
            labeled = {
                **template,
                "metadata": {
                    "labels": {**template["metadata"]["labels"], "batch.kubernetes.io/job-completion-index": str(index)}
                },
            }
            try:
                pod = self.cluster.make_pod(name, self.name, _namespace(self.job), labeled, self.subnet, env)
                self.running.append(_Running(pod, index, self._start(pod)))
            except Refused as exc:
                self.refused = str(exc)
                return

    def _fail(self) -> None:
        self.condition = "Failed"
        for running in self.running:
            _kill_group(running.process.pid, signal.SIGKILL)


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
