"""Hosts of their own on one machine for multi-host tests: network namespaces joined by a veth pair.

    with two_hosts() as (a, b):          # a.ip == "10.231.0.1", b.ip == "10.231.0.2"
        a.run(["bash", "scripts/ray_head.sh", "--iface", a.iface, ...])
        b.popen([...])

Each host is a namespace with its loopback and one veth end, on a /24 of its own (no route out, no
NAT): traffic between the hosts stays on the pair, and nothing in them reaches another address. The
file systems, /dev/shm and the process table are the machine's (only the network is separate), so a
host's processes are found and killed by what they were started with. Root only (`skip_reason`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.231.0"
"""The hosts' /24: host i (from 1) is SUBNET.i."""


@dataclass(frozen=True)
class Host:
    namespace: str
    iface: str
    ip: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)


def skip_reason() -> str | None:
    """Why this machine cannot make the hosts (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"mrlprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], check=True)
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two hosts joined by a veth pair; removed (with their links) on the way out, also after a failure."""
    tag = uuid.uuid4().hex[:6]
    hosts = (Host(f"mrl{tag}a", f"mrl{tag}a", f"{SUBNET}.1"), Host(f"mrl{tag}b", f"mrl{tag}b", f"{SUBNET}.2"))
    made: list[str] = []
    try:
        for host in hosts:
            subprocess.run(["ip", "netns", "add", host.namespace], check=True)
            made.append(host.namespace)
        a, b = hosts
        subprocess.run(["ip", "link", "add", a.iface, "type", "veth", "peer", "name", b.iface], check=True)
        for host in hosts:
            subprocess.run(["ip", "link", "set", host.iface, "netns", host.namespace], check=True)
            host.run(["ip", "addr", "add", f"{host.ip}/24", "dev", host.iface], check=True)
            host.run(["ip", "link", "set", host.iface, "up"], check=True)
            host.run(["ip", "link", "set", "lo", "up"], check=True)
        yield hosts
    finally:
        for namespace in made:  # deleting a namespace deletes its veth end, and the pair with it
            subprocess.run(["ip", "netns", "delete", namespace], check=False)
