"""Whether a worker group's rank processes are alive and running, whatever they compute.

A rank process that is alive but does not run (stopped by SIGSTOP or a debugger, a frozen container, a
node cut off from the cluster) neither answers nor dies: its peers wait for it in their next collective
and the driver waits for them all. Each rank process therefore runs a thread that bumps a counter in the
Ray cluster's key-value store (the GCS) every `BEAT_S`; the thread beats while the rank computes or waits in
a collective (torch and Ray release the GIL there), and stops only when the whole process does. The
driver reads the counters of the ranks it waits on: a counter that has not moved for the timeout names
the stuck rank.

    Heartbeat(key).start()                            # in a rank process
    watch = HeartbeatWatch([key0, key1], timeout_s)   # in the driver
    watch.silent([0, 1])                              # ranks whose beat has not moved for timeout_s
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ray.experimental import internal_kv

BEAT_S = 1.0
"""How often a rank process beats."""
NAMESPACE = "megarl_heartbeat"


class Heartbeat:
    """A daemon thread that bumps `key`'s counter every `BEAT_S` for as long as its process runs."""

    def __init__(self, key: str):
        self.key = key.encode()

    def start(self) -> None:
        threading.Thread(target=self._beat, name="megarl-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        count = 0
        while True:
            count += 1
            try:
                internal_kv._internal_kv_put(self.key, str(count).encode(), overwrite=True, namespace=NAMESPACE)
            except Exception:
                pass
            time.sleep(BEAT_S)


class HeartbeatWatch:
    """The driver's view of a group's heartbeats (`keys`, one per rank)."""

    def __init__(self, keys: list[str], timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.keys = [key.encode() for key in keys]
        self.timeout_s = timeout_s
        self.clock = clock
        self.seen: dict[int, tuple[bytes, float]] = {}
        """Rank -> (its counter when last read, when it last changed)."""

    def read(self, ranks: list[int]) -> dict[int, bytes | None]:
        """Each rank's counter now (None before its first beat)."""
        return {rank: internal_kv._internal_kv_get(self.keys[rank], namespace=NAMESPACE) for rank in ranks}

    def silent(self, ranks: list[int]) -> list[int]:
        """The `ranks` whose counter has not moved for `timeout_s` (as far as these calls saw). A rank that
        never beat is not judged: it may still be starting (its process scheduled, its imports running)."""
        now, stuck = self.clock(), []
        for rank, count in self.read(ranks).items():
            if count is None:
                continue
            last, since = self.seen.get(rank, (None, now))
            if count != last:
                self.seen[rank] = (count, now)
            elif now - since >= self.timeout_s:
                stuck.append(rank)
        return stuck

    def forget(self) -> None:
        """Delete the group's counters (the group is gone)."""
        for key in self.keys:
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)
