"""Helpers for the deploy/ tests: render kustomizations, walk workloads and containers.

Pure functions over rendered manifests (lists of dicts) plus two subprocess wrappers: ``render``
runs ``kubectl kustomize DIR`` and ``render_stack`` renders an overlay with optional components
stacked on top (the way deploy/README.md tells users to add them). Reading ``leafe <verb> --help``
is in clihelp.py.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "COMPONENT_STACKS",
    "DEPLOY",
    "K8S_VERSION",
    "KUSTOMIZATIONS",
    "NAMESPACES",
    "NATS_ROLES",
    "NATS_VERBS",
    "OPTIONAL_COMPONENTS",
    "OVERLAYS",
    "PENDING_CODE",
    "ROOT",
    "SCHEMALESS_KINDS",
    "Container",
    "Doc",
    "Stacks",
    "config_map_value",
    "container_named",
    "containers",
    "env_names",
    "env_value",
    "expand_shell",
    "find",
    "flags_of",
    "leafe_invocation",
    "mounted_secret_file",
    "parse_quantity",
    "pod_templates",
    "pods_running",
    "pods_with_label",
    "render",
    "render_stack",
    "weight_mounts",
    "workload_names",
]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
Doc = dict[str, Any]
Stacks = dict[tuple[str, tuple[str, ...]], list[Doc]]
"""Rendered documents by ``(overlay, optional components stacked on it)``."""
K8S_VERSION = "1.32"
KUSTOMIZATIONS = {
    "dev": "overlays/dev",
    "gpu": "overlays/gpu",
    "dev-replay": "overlays/dev/replay",
    "gpu-replay": "overlays/gpu/replay",
    "dev-tasks": "overlays/dev/tasks",
    "gpu-tasks": "overlays/gpu/tasks",
}
"""Every kustomization the tests render, by short name (paths under deploy/)."""
OVERLAYS = ("dev", "gpu")
NAMESPACES = {"dev": "leafe-dev", "gpu": "leafe"}
"""The namespace of each overlay (and of its replay kustomization)."""
OPTIONAL_COMPONENTS = (
    "prometheus-annotations",
    "monitoring",
    "keda-actors",
    "sandbox-gvisor",
    "sandbox-userns",
)
"""Components under deploy/components/ that a user stacks on an overlay (deploy/README.md)."""
_EXCLUSIVE = frozenset(
    {"sandbox-gvisor", "sandbox-userns"}
)  # two ways to the same end: one at a time
COMPONENT_STACKS: tuple[tuple[str, ...], ...] = tuple(
    combo
    for n in range(1, len(OPTIONAL_COMPONENTS) + 1)
    for combo in itertools.combinations(OPTIONAL_COMPONENTS, n)
    if not _EXCLUSIVE <= set(combo)
)
"""Every combination of optional components (except both sandboxes at once), for each overlay."""
SCHEMALESS_KINDS = frozenset(
    {("monitoring.coreos.com/v1", "PodMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
)
"""CRD kinds kubernetes-validate has no schema for: checked by the component tests, not strictly."""
NATS_ROLES = {
    "actor": "actor",
    "replayer": "replayer",
    "replay": "replayer",
    "learner": "learner",
    "weight-sync": "weight-sync",
    "streams": "admin",
    "tasks": "admin",
    "eval": "admin",
}
"""The NATS user (a role of base/nats/permissions.json) of each NATS-using verb."""
NATS_VERBS = frozenset(NATS_ROLES)
"""Verbs whose services connect to NATS (and so need a NATS user and the NetworkPolicy label)."""
PENDING_CODE: dict[str, frozenset[str] | None] = {}
"""Verbs (None: the whole verb) and flags the manifests use that the services are being given now
(see deploy/README.md). Accepted while missing; test_pending_code_is_still_pending fails once one
exists, so the entry is removed and the real --help check takes over."""
_WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


def render(kustomization: Path, kubectl: str) -> list[Doc]:
    """``kubectl kustomize DIR`` parsed into documents; raises with kubectl's stderr on failure."""
    proc = subprocess.run(
        [kubectl, "kustomize", str(kustomization)], capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize {kustomization} failed:\n{proc.stderr}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def render_stack(overlay: str, components: Sequence[str], workdir: Path, kubectl: str) -> list[Doc]:
    """An overlay with optional components on top, rendered from a kustomization in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)

    def rel(path: str) -> str:  # kustomize accepts only relative paths to other kustomizations
        return os.path.relpath(DEPLOY / path, workdir)

    lines = [
        "apiVersion: kustomize.config.k8s.io/v1beta1",
        "kind: Kustomization",
        f"namespace: {NAMESPACES[overlay]}",
        f"resources: [{rel(KUSTOMIZATIONS[overlay])}]",
        f"components: [{', '.join(rel('components/' + c) for c in components)}]",
    ]
    (workdir / "kustomization.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return render(workdir, kubectl)


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    """The one document of ``kind`` whose name is ``name`` (or starts with ``name-`` + a hash
    suffix)."""
    hits = [
        d
        for d in docs
        if d["kind"] == kind
        and (
            d["metadata"]["name"] == name
            or re.fullmatch(rf"{re.escape(name)}-[a-z0-9]{{10}}", d["metadata"]["name"])
        )
    ]
    if len(hits) != 1:
        raise AssertionError(f"expected one {kind} named {name!r}, found {len(hits)}")
    return hits[0]


def pod_templates(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """``(workload, pod template)`` for every workload kind that has ``spec.template``."""
    for doc in docs:
        if doc["kind"] in _WORKLOAD_KINDS:
            yield doc, doc["spec"]["template"]
        elif doc["kind"] == "CronJob":
            yield doc, doc["spec"]["jobTemplate"]["spec"]["template"]


@dataclass(frozen=True, kw_only=True)
class Container:
    """One container of a rendered workload, with the pod it belongs to."""

    workload: Doc
    pod: Doc
    spec: Doc

    @property
    def where(self) -> str:
        """``Kind/name:container`` for error messages."""
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}:{self.spec['name']}"

    @property
    def raw_argv(self) -> list[str]:
        """``command + args`` as strings, as written in the manifest."""
        return [str(a) for a in (self.spec.get("command") or []) + (self.spec.get("args") or [])]

    @property
    def argv(self) -> list[str]:
        """``raw_argv`` with each ``sh -c SCRIPT`` replaced by the script's words
        (:func:`expand_shell`)."""
        return expand_shell(self.raw_argv)[0]


_SHELLS = {"sh", "/bin/sh", "bash", "/bin/bash"}


def expand_shell(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(argv, scripts)``: each ``sh -c SCRIPT`` becomes SCRIPT's words (a leading ``exec``
    dropped)."""
    for i, token in enumerate(argv[:-2]):
        if token in _SHELLS and argv[i + 1] == "-c":
            words = shlex.split(argv[i + 2])
            if words and words[0] == "exec":
                words = words[1:]
            return argv[:i] + words + argv[i + 3 :], [argv[i + 2]]
    return argv, []


def containers(docs: list[Doc], *, init: bool = True) -> Iterator[Container]:
    """Every container (and init container) of every workload."""
    for workload, template in pod_templates(docs):
        pod = template["spec"]
        keys = ("initContainers", "containers") if init else ("containers",)
        for key in keys:
            for spec in pod.get(key) or []:
                yield Container(workload=workload, pod=template, spec=spec)


def leafe_invocation(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(verb, arguments)`` when ``argv`` runs ``leafe <verb> ...`` (directly or under
    torchrun)."""
    for i, token in enumerate(argv):
        if (token == "leafe" or token.endswith("/leafe")) and i + 1 < len(argv):
            return argv[i + 1], argv[i + 2 :]
    return None


def flags_of(args: list[str]) -> set[str]:
    """The long options in an argument list (``--x`` and ``--x=value`` both give ``--x``)."""
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def env_names(container: Container, docs: list[Doc]) -> set[str]:
    """Names of every environment variable the container gets (env and envFrom
    ConfigMaps/Secrets)."""
    names = {e["name"] for e in container.spec.get("env") or []}
    for source in container.spec.get("envFrom") or []:
        if "configMapRef" in source:
            names |= set(find(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
        if (
            "secretRef" in source
        ):  # a Secret the operator creates (gpu) is not rendered: no names known
            secrets = [
                d
                for d in docs
                if d["kind"] == "Secret" and d["metadata"]["name"] == source["secretRef"]["name"]
            ]
            names |= {key for secret in secrets for key in secret.get("data", {})}
    return names


def workload_names(docs: list[Doc]) -> dict[str, str]:
    """``{name: kind}`` of every workload."""
    return {w["metadata"]["name"]: w["kind"] for w, _ in pod_templates(docs)}


def container_named(docs: list[Doc], workload: str, name: str) -> Container:
    """The one container ``name`` of workload ``workload``."""
    hits = [
        c
        for c in containers(docs)
        if c.workload["metadata"]["name"] == workload and c.spec["name"] == name
    ]
    assert len(hits) == 1, f"expected one container {workload}:{name}, found {len(hits)}"
    return hits[0]


def env_value(container: Container, name: str) -> str:
    """The literal value of env var ``name`` of a container."""
    for item in container.spec.get("env") or []:
        if item["name"] == name and "value" in item:
            return str(item["value"])
    raise AssertionError(f"{container.where} has no literal env {name}")


def weight_mounts(container: Container) -> list[Doc]:
    """The container's mounts of the weight volume (PVC leafe-weights)."""
    volumes = {v["name"]: v for v in container.pod["spec"].get("volumes") or []}
    return [
        m
        for m in container.spec.get("volumeMounts") or []
        if volumes.get(m["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
        == "leafe-weights"
    ]


def mounted_secret_file(container: Container, path: str) -> tuple[str, str] | None:
    """``(Secret name, key)`` of the Secret file mounted at ``path`` in the container, or None."""
    volumes = {v["name"]: v for v in container.pod["spec"].get("volumes") or []}
    for mount in container.spec.get("volumeMounts") or []:
        secret = volumes.get(mount["name"], {}).get("secret")
        directory = mount["mountPath"].rstrip("/")
        if secret is None or mount.get("subPath") or not path.startswith(directory + "/"):
            continue
        name = path[len(directory) + 1 :]
        items = secret.get("items")
        keys = {i["path"]: i["key"] for i in items} if items else None
        if keys is None or name in keys:
            return secret["secretName"], keys[name] if keys else name
    return None


def config_map_value(docs: list[Doc], name: str, key: str) -> str:
    """``data[key]`` of ConfigMap ``name`` (hash suffix allowed)."""
    return str(find(docs, "ConfigMap", name)["data"][key])


def pods_with_label(docs: list[Doc], label: str) -> set[str]:
    """Names of the workloads whose pods carry ``label: "true"``."""
    return {
        w["metadata"]["name"]
        for w, t in pod_templates(docs)
        if t["metadata"]["labels"].get(label) == "true"
    }


def pods_running(docs: list[Doc], verbs: Collection[str]) -> set[str]:
    """Names of the workloads with a container running one of ``leafe <verbs>``."""
    return {
        c.workload["metadata"]["name"]
        for c in containers(docs)
        if (inv := leafe_invocation(c.argv)) and inv[0] in verbs
    }


_QUANTITY = re.compile(r"^([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_FACTORS = {
    None: 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}


def parse_quantity(value: object) -> float:
    """A Kubernetes resource quantity (``500m``, ``2``, ``4Gi``) as a float in base units."""
    match = _QUANTITY.match(str(value))
    if not match:
        raise AssertionError(f"unsupported resource quantity {value!r}")
    return float(match.group(1)) * _FACTORS[match.group(2)]
