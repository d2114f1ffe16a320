"""Paths and small helpers shared by the deployment tests (imported by name: tests/deploy is on sys.path)."""

import copy
import functools
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
KUBERAY_SCHEMAS = REPO.parent / "shared" / "kuberay"
"""KubeRay v1.7.0 CRD JSON Schemas; CI runs with shared/ beside the repository (../shared/kuberay)."""
VENV_BIN = Path(sys.executable).parent
"""The environment's bin/ (ray, shellcheck, hadolint, megarl), put first on PATH for the scripts."""


def kustomize(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` renders, fresh copies (tests change them); the test is
    skipped where kubectl is not installed."""
    return copy.deepcopy(_kustomize(str(directory)))


@functools.cache
def _kustomize(directory: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests are rendered with `kubectl kustomize`")
    result = subprocess.run([kubectl, "kustomize", directory], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {directory}: {result.stderr}"
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 right now (from the OS's ephemeral range)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def project() -> dict:
    """pyproject.toml's [project] table."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirements(*extras: str) -> list[Requirement]:
    """pyproject.toml's dependencies, then those of each of `extras`, in order."""
    table = project()
    return [
        Requirement(line)
        for line in [
            *table["dependencies"],
            *(line for extra in extras for line in table["optional-dependencies"][extra]),
        ]
    ]


def constraints() -> dict[str, str]:
    """constraints.txt: canonical package name -> pinned version."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(requirement.name)] = spec.version
    return pins
