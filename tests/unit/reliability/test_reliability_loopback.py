"""megarl's own rendezvous store listens on the address it is given, not on every interface as a
`TCPStore` left to itself does. (A whole local run's sockets: tests/e2e/reliability/test_security.py.)"""

import datetime

import psutil
import torch.distributed as dist

from megarl.parallel.distributed import is_loopback, listen_store


def listening_ports() -> dict[int, str]:
    return {c.laddr.port: c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def test_listen_store_listens_on_its_host_alone_and_serves_peers():
    store = listen_store("127.0.0.1", 2, timeout_s=10)
    assert listening_ports()[store.port] == "127.0.0.1"
    peer = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
    peer.set("key", "value")
    assert store.get("key") == b"value"


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("192.0.2.7")
