"""`run_distributed`'s ranks never outlive it (issue 33, items 7 and 10): a stop requested by a signal
(`megarl.interrupt`) is raised at its next poll and the ranks are killed on the way out; a parent killed
outright (SIGKILL: no clean-up runs) takes its ranks with it (each rank watches its caller's pidfd). A rank's
own children go with it (each rank leads a process group, killed whole)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from process_testing import sleep_beside_a_child, spawned_ranks

from megarl import interrupt
from megarl.interrupt import Stopped
from megarl.parallel.spawn import run_distributed

TESTS = Path(__file__).resolve().parents[2]
SLEEPER = (
    "from process_testing import sleep_beside_a_child; from megarl.parallel.spawn import run_distributed; "
    "run_distributed(sleep_beside_a_child, 2, 600)"
)


def ranks_and_children(pid: int, count: int, before: set[int] = frozenset(), timeout_s: float = 120.0):
    """The `count` rank processes of `pid` not in `before` and their children, once each rank has one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ranks = [p for p in spawned_ranks(psutil.Process(pid)) if p.pid not in before]
        children = [child for rank in ranks for child in _children(rank)]
        if len(ranks) >= count and len(children) >= count:
            return ranks + children
        time.sleep(0.2)  # polling the process table: there is no event to wait on
    raise AssertionError(f"{count} ranks of {pid}, each with a child, did not start within {timeout_s} s")


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children()
    except psutil.NoSuchProcess:
        return []


def running(processes: list[psutil.Process]) -> list[int]:
    """The pids of `processes` still running (a zombie has ended)."""
    _, alive = psutil.wait_procs(processes, timeout=30)
    return [p.pid for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_killed_parent_takes_its_ranks_and_their_children_with_it():
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", SLEEPER], env=environment)
    processes = []
    try:
        processes = ranks_and_children(parent.pid, 2)
        parent.kill()
        parent.wait()
        assert running(processes) == []
    finally:
        parent.kill()
        for process in processes:  # orphans of a failed case: their parent is gone
            if process.is_running():
                process.kill()


def test_a_requested_stop_ends_the_world_its_ranks_and_their_children(monkeypatch):
    monkeypatch.setattr(interrupt, "_requested", None)
    me = os.getpid()
    before = {p.pid for p in spawned_ranks(psutil.Process(me))}  # whatever earlier tests left running here
    processes: list[psutil.Process] = []

    def stop_once_started():
        try:
            processes.extend(ranks_and_children(me, 2, before))
        finally:
            interrupt.request(Stopped(signal.SIGTERM, None))

    requester = threading.Thread(target=stop_once_started)
    requester.start()
    with pytest.raises(Stopped):
        run_distributed(sleep_beside_a_child, 2, 600, timeout_s=180)
    requester.join()
    assert len(processes) == 4
    assert running(processes) == []
