"""Paths and small helpers shared by the deployment tests (imported by name: tests/deploy is on sys.path)."""

import copy
import functools
import runpy
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools
import yaml

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


def setup_kwargs(monkeypatch) -> dict:
    """setup.py's arguments, captured by running it with setuptools.setup replaced."""
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "setup.py"))
    return captured
