"""A renderer for the subset of kustomize that k8s/ uses, so the manifests can be checked without kubectl.

Supported: `resources` (files and directories, recursively), `patches` with a `target` and a JSON6902
body (add / replace / remove), `namePrefix` / `nameSuffix` (on metadata.name), `labels` (pairs on
metadata.labels). Anything else in a kustomization.yaml is an error, so a new feature in k8s/ cannot
be silently ignored here. Where `kubectl` is installed, tests/deploy compares this output with
`kubectl kustomize` (the real contract).
"""

import copy
from pathlib import Path

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "namePrefix", "nameSuffix", "labels"}


class KustomizeError(ValueError):
    """A kustomization this renderer does not support or cannot apply."""


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` would print, in resource order."""
    file = Path(directory) / "kustomization.yaml"
    spec = yaml.safe_load(file.read_text())
    unsupported = set(spec) - SUPPORTED_KEYS
    if unsupported:
        raise KustomizeError(f"{file}: {sorted(unsupported)} not supported by tests/deploy/kustomize_lite.py; "
                             f"extend it (and its kubectl cross-check) or use only {sorted(SUPPORTED_KEYS)}")
    objects = []
    for resource in spec.get("resources", []):
        path = (file.parent / resource).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [obj for obj in yaml.safe_load_all(path.read_text()) if obj]
    for patch in spec.get("patches", []):
        _apply_patch(objects, patch, file)
    for obj in objects:
        meta = obj.setdefault("metadata", {})
        meta["name"] = spec.get("namePrefix", "") + meta["name"] + spec.get("nameSuffix", "")
        for entry in spec.get("labels", []):
            if entry.get("includeSelectors") or entry.get("includeTemplates"):
                raise KustomizeError(f"{file}: labels with includeSelectors/includeTemplates not supported")
            meta.setdefault("labels", {}).update(entry["pairs"])
    return objects


def _apply_patch(objects: list[dict], patch: dict, file: Path) -> None:
    if set(patch) != {"target", "patch"}:
        raise KustomizeError(f"{file}: only inline JSON6902 patches with a target are supported, "
                             f"got keys {sorted(patch)}")
    operations = yaml.safe_load(patch["patch"])
    if not isinstance(operations, list):
        raise KustomizeError(f"{file}: patch for {patch['target']} is not a JSON6902 list of operations")
    matches = [obj for obj in objects if _matches(obj, patch["target"])]
    if not matches:
        raise KustomizeError(f"{file}: patch target {patch['target']} matches no resource")
    for obj in matches:
        for operation in operations:
            _apply_operation(obj, operation)


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    facts = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"]}
    return all(facts[key] == value for key, value in target.items())


def _apply_operation(obj: dict, operation: dict) -> None:
    """RFC 6902 add / replace / remove at a JSON pointer (RFC 6901)."""
    op, pointer = operation["op"], operation["path"]
    keys = [part.replace("~1", "/").replace("~0", "~") for part in pointer.split("/")[1:]]
    parent = obj
    for key in keys[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last = keys[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op == "add":
            parent.insert(index, copy.deepcopy(operation["value"]))
        elif op == "replace":
            parent[index] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del parent[index]
        else:
            raise KustomizeError(f"JSON6902 op {op!r} not supported")
        return
    if op in ("replace", "remove") and last not in parent:
        raise KustomizeError(f"JSON6902 {op} at {pointer}: no such field")
    if op in ("add", "replace"):
        parent[last] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del parent[last]
    else:
        raise KustomizeError(f"JSON6902 op {op!r} not supported")
