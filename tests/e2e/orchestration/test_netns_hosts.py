"""The hosts that the multi-host tests make (`tests/netns_testing.py`): they reach each other over the
switch and nothing else, a cut host is unreachable until reconnected, a host's processes are told apart by
namespace, and nothing of them is left after the `with`, also after a failure."""

from __future__ import annotations

import subprocess
import sys

import pytest
from netns_testing import hosts, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
while True:
    server.accept()[0].close()
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError as error:
    sys.exit(f"{type(error).__name__}: {error}")
"""


def connects(host, address: str, port: int, timeout_s: float = 1.0) -> subprocess.CompletedProcess:
    return host.run(
        [sys.executable, "-c", CONNECT, address, str(port), str(timeout_s)], capture_output=True, text=True, timeout=30
    )


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def links_here() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def made_by(group) -> set[str]:
    return {host.namespace for host in group} | {host.switch for host in group}


def test_hosts_reach_each_other_and_nothing_else_and_a_cut_host_goes_silent():
    with hosts(3) as (a, b, c):
        assert made_by((a, b, c)) <= namespaces()
        assert [a.ip, b.ip, c.ip] == ["10.231.0.1", "10.231.0.2", "10.231.0.3"]
        assert a.iface not in links_here() and b.iface not in links_here()  # nothing in the machine's namespace
        for host in (a, b, c):  # no default route: any address off the subnet is unreachable at once
            route = host.run(["ip", "route", "get", "1.1.1.1"], capture_output=True, text=True)
            assert route.returncode != 0 and "unreachable" in route.stderr, route.stdout + route.stderr
        server = b.popen([sys.executable, "-c", LISTEN, b.ip], stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            assert server.pid in b.pids() and server.pid not in a.pids()
            assert connects(a, b.ip, port).returncode == 0 and connects(c, b.ip, port).returncode == 0
            b.cut()
            cut = connects(a, b.ip, port)
            assert cut.returncode != 0 and "timed out" in cut.stderr, cut.stderr  # silence, not a reset
            assert connects(c, b.ip, port).returncode != 0
            b.reconnect()
            assert connects(a, b.ip, port, timeout_s=10.0).returncode == 0
        finally:
            server.kill()
            server.wait()
    assert not made_by((a, b, c)) & namespaces()


def test_hosts_are_removed_after_a_failure():
    made = []
    with pytest.raises(RuntimeError, match="test failed inside"), hosts(2) as group:
        made.extend(group)
        raise RuntimeError("test failed inside")
    assert len(made) == 2 and not made_by(made) & namespaces()
