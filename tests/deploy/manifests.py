"""The deploy files as data, for the tests in this package: compose.yaml, and the Kubernetes
manifests rendered the way `kubectl kustomize` renders them.

The renderer covers the part of kustomize that deploy/kubernetes uses: `resources` (files and other
kustomization folders) and `patches` with strategic-merge patches. A strategic merge merges maps key
by key, merges the lists Kubernetes merges by key (containers and env by name, ...) with the patch's
items first and the rest in their old order, and replaces every other list. Anything else in a
kustomization is refused, so a new feature there fails loudly here instead of rendering wrong;
test_kubernetes checks this renderer against kubectl's wherever kubectl is installed.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KUSTOMIZATIONS = {"base": KUBERNETES / "base", "cpu": KUBERNETES / "overlays" / "cpu",
                  "gpu": KUBERNETES / "overlays" / "gpu"}

Doc = dict[str, Any]

# The lists a strategic merge patch merges item by item, and the key it matches items on.
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
               "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}
_SUPPORTED = {"apiVersion", "kind", "resources", "patches"}


def load_docs(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(folder: Path) -> list[Doc]:
    """The documents `kubectl kustomize folder` prints, in the same order."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - _SUPPORTED
    assert not unsupported, f"{folder}: this renderer does not do {sorted(unsupported)}; extend it"
    docs: list[Doc] = []
    for entry in kustomization.get("resources", []):
        target = (folder / entry).resolve()
        docs.extend(render(target) if target.is_dir() else load_docs(target))
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{folder}: only file patches are rendered here, not {patch}"
        for change in load_docs(folder / patch["path"]):
            matches = [i for i, doc in enumerate(docs) if _identity(doc) == _identity(change)]
            assert len(matches) == 1, f"{folder}: patch {_identity(change)} matches {len(matches)} resources"
            docs[matches[0]] = strategic_merge(docs[matches[0]], change)
    return docs


def strategic_merge(original: Any, patch: Any, field: str = "") -> Any:
    if isinstance(original, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(original)
        for key, value in patch.items():
            merged[key] = strategic_merge(original[key], value, key) if key in original else copy.deepcopy(value)
        return merged
    if isinstance(original, list) and isinstance(patch, list) and field in _MERGE_KEYS:
        key = _MERGE_KEYS[field]
        old = {item[key]: item for item in original}
        ours = [strategic_merge(old[item[key]], item, field) if item[key] in old else copy.deepcopy(item)
                for item in patch]
        patched = {item[key] for item in patch}
        return ours + [copy.deepcopy(item) for item in original if item[key] not in patched]
    return copy.deepcopy(patch)


def _identity(doc: Doc) -> tuple[str, str, str]:
    return doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else "", doc["kind"], doc["metadata"]["name"]


def kubectl_render(folder: Path) -> list[Doc] | None:
    """kubectl's own rendering, or None where kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    done = subprocess.run([kubectl, "kustomize", str(folder)], check=True, capture_output=True, text=True,
                          timeout=60)
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [doc for doc in docs if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"want one {kind} {name}, found {len(found)}"
    return found[0]


def pod_spec(docs: list[Doc], name: str) -> Doc:
    spec: Doc = find(docs, "Deployment", name)["spec"]["template"]["spec"]
    return spec


def container(docs: list[Doc], deployment: str, name: str, *, init: bool = False) -> Doc:
    listed = pod_spec(docs, deployment)["initContainers" if init else "containers"]
    found = [c for c in listed if c["name"] == name]
    assert len(found) == 1, f"{deployment}: want one container {name}"
    return found[0]


def env_of(spec: Doc) -> dict[str, Doc]:
    """A container's env entries by name (a name listed twice is an error kubectl would not report)."""
    entries = spec.get("env", [])
    names = [entry["name"] for entry in entries]
    assert len(names) == len(set(names)), f"{spec['name']}: env names repeated: {names}"
    return {entry["name"]: entry for entry in entries}
