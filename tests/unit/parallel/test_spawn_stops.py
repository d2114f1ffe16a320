"""`run_distributed`'s ranks never outlive it (issue 33, items 7 and 10): a stop requested by a signal
(`megarl.interrupt`) is raised at its next poll and the ranks are killed on the way out; a parent killed
outright (SIGKILL: no clean-up runs) takes its ranks with it (each rank watches its caller's pidfd)."""

import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from process_testing import spawned_ranks

from megarl import interrupt
from megarl.interrupt import Stopped
from megarl.parallel.spawn import run_distributed

SLEEPER = "import time; from megarl.parallel.spawn import run_distributed; run_distributed(time.sleep, 2, 600)"


def children_of(pid: int, count: int, timeout_s: float = 120.0) -> list[psutil.Process]:
    """The `count` rank processes of `pid`, once they exist."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ranks = spawned_ranks(psutil.Process(pid))
        if len(ranks) >= count:
            return ranks
        time.sleep(0.2)  # polling the process table: there is no event to wait on
    raise AssertionError(f"{count} ranks of {pid} did not start within {timeout_s} s")


def test_a_killed_parent_takes_its_ranks_with_it():
    parent = subprocess.Popen([sys.executable, "-c", SLEEPER])
    ranks = []
    try:
        ranks = children_of(parent.pid, 2)
        parent.kill()
        parent.wait()
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert alive == [], [p.pid for p in alive]
    finally:
        parent.kill()
        for process in ranks:  # orphans of a failed case: their parent is gone
            if process.is_running():
                process.kill()


def test_a_requested_stop_ends_the_world_and_its_ranks(monkeypatch):
    monkeypatch.setattr(interrupt, "_requested", None)
    me = psutil.Process()
    before = {p.pid for p in spawned_ranks(me)}  # whatever earlier tests left running under this process
    ranks: list[psutil.Process] = []

    def new_ranks() -> list[psutil.Process]:
        return [process for process in spawned_ranks(me) if process.pid not in before]

    def stop_once_started():
        deadline = time.monotonic() + 120
        while len(new_ranks()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # polling the process table: there is no event to wait on
        ranks.extend(new_ranks())
        interrupt.request(Stopped(signal.SIGTERM, None))

    requester = threading.Thread(target=stop_once_started)
    requester.start()
    with pytest.raises(Stopped):
        run_distributed(time.sleep, 2, 600, timeout_s=180)
    requester.join()
    assert len(ranks) == 2
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
