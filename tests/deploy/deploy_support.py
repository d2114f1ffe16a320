"""Paths and small helpers shared by the deployment tests (imported by name: tests/deploy is on sys.path)."""

import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KUBERAY_SCHEMAS = REPO.parent / "shared" / "kuberay"
"""KubeRay v1.7.0 CRD JSON Schemas; CI runs with shared/ beside the repository (../shared/kuberay)."""
VENV_BIN = Path(sys.executable).parent
"""The environment's bin/ (ray, shellcheck, hadolint, megarl), put first on PATH for the scripts."""


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
