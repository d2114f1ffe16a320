"""Hosts of their own on one machine for multi-host tests: network namespaces on one switch.

    with hosts(2) as (a, b):          # a.ip == "10.231.0.1", b.ip == "10.231.0.2"
        a.run(["bash", "scripts/ray_head.sh", "--iface", a.iface, ...])
        b.popen([...])
        b.cut()                       # its cable out of the switch: A hears nothing from B, B nothing from A
        b.reconnect()

Each host is a network namespace with its loopback and one end of a veth pair; the other ends are the
ports of a Linux bridge (the switch) in a namespace of its own. Every link is made inside those
namespaces (`ip -n`), so the machine's own namespace never gets an interface or a route; the hosts are on
a /24 of their own with no default route and no NAT: traffic between them stays on the switch, and
nothing in them reaches any other address. Cutting a host takes its switch port down: its peers' packets
to it vanish (no reset, as with a pulled cable), and it sees its link without carrier.

The file systems, /dev/shm and the process table are the machine's (only the network is separate): a
host's processes are those in its network namespace (`Host.pids`). Root only (`skip_reason`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.231.0"
"""The hosts' /24: host i (from 1) is SUBNET.i."""
MAX_HOSTS = 8


@dataclass(frozen=True)
class Host:
    namespace: str
    iface: str
    """Its interface on the switch (inside `namespace`)."""
    ip: str
    switch: str
    """The namespace of the bridge its cable is plugged into."""
    port: str
    """The switch's end of its cable (inside `switch`)."""

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def cut(self) -> None:
        """Unplug this host from the switch."""
        subprocess.run(["ip", "-n", self.switch, "link", "set", self.port, "down"], check=True)

    def reconnect(self) -> None:
        """Plug it back in (its address and route come back with the carrier)."""
        subprocess.run(["ip", "-n", self.switch, "link", "set", self.port, "up"], check=True)

    def pids(self) -> list[int]:
        """The processes running in this host's network namespace now."""
        namespace = os.stat(Path("/run/netns") / self.namespace).st_ino
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):  # ended meanwhile, or a kernel thread
                    if os.stat(entry / "ns" / "net").st_ino == namespace:
                        found.append(int(entry.name))
        return sorted(found)


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
    try:
        bridge = subprocess.run(f"ip -n {probe} link add br0 type bridge".split(), capture_output=True, text=True)
        if bridge.returncode != 0:
            return f"a Linux bridge cannot be made (`ip link add type bridge`): {bridge.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], check=True)
    return None


@contextlib.contextmanager
def hosts(count: int) -> Iterator[tuple[Host, ...]]:
    """`count` hosts on one switch; removed (with their links) on the way out, also after a failure.
    Processes still running in a host keep its namespace (unnamed) until they end: stop them first."""
    assert 1 <= count <= MAX_HOSTS, f"1 to {MAX_HOSTS} hosts"
    tag = uuid.uuid4().hex[:6]
    switch = f"mrl{tag}sw"
    made: list[str] = []

    def ip(arguments: str) -> None:
        """`ip ARGUMENTS` (names and addresses here hold no spaces)."""
        subprocess.run(["ip", *arguments.split()], check=True, capture_output=True)

    try:
        ip(f"netns add {switch}")
        made.append(switch)
        ip(f"-n {switch} link add br0 type bridge")
        ip(f"-n {switch} link set br0 up")
        made_hosts = []
        for index in range(1, count + 1):
            host = Host(f"mrl{tag}h{index}", f"mrl{tag}h{index}", f"{SUBNET}.{index}", switch, f"port{index}")
            ip(f"netns add {host.namespace}")
            made.append(host.namespace)
            # Both ends made in their namespaces: no name or route ever appears in the machine's own.
            ip(f"-n {switch} link add {host.port} type veth peer name {host.iface} netns {host.namespace}")
            ip(f"-n {switch} link set {host.port} master br0")
            ip(f"-n {switch} link set {host.port} up")
            ip(f"-n {host.namespace} addr add {host.ip}/24 dev {host.iface}")
            ip(f"-n {host.namespace} link set {host.iface} up")
            ip(f"-n {host.namespace} link set lo up")
            made_hosts.append(host)
        yield tuple(made_hosts)
    finally:
        for namespace in reversed(made):  # a namespace takes its veth ends, and so the pairs, with it
            subprocess.run(["ip", "netns", "delete", namespace], check=False, capture_output=True)
