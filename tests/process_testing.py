"""Waiting for processes the tests killed (shared by the reward and tool isolation tests)."""

import subprocess
import time

import psutil


def wait_until_gone(pid: int, timeout_s: float = 10.0) -> bool:
    """True once `pid` no longer runs (reaped, or a zombie waiting for a parent that is not us)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)  # polling the condition itself
    return False


def spawned_ranks(ancestor: psutil.Process) -> list[psutil.Process]:
    """The `megarl.parallel.spawn` ranks among `ancestor`'s descendants: the children of a multiprocessing
    fork server (`spawn._context`). A forked rank keeps its server's command line, so a rank's own children
    have a parent that reads like a fork server too: the server's parent is not one."""
    ranks = []
    for process in ancestor.children(recursive=True):
        try:
            parent = process.parent()
            if parent is not None and _is_fork_server(parent) and not _is_fork_server(parent.parent()):
                ranks.append(process)
        except psutil.Error:  # ended meanwhile
            pass
    return ranks


def _is_fork_server(process: psutil.Process | None) -> bool:
    return process is not None and "multiprocessing.forkserver" in " ".join(process.cmdline())


def command_line(pid: str) -> bytes:
    """Process `pid`'s raw command line (NUL-separated), or b"" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()
    except OSError:
        return b""


def sleep_beside_a_child(seconds: float) -> None:
    """A `run_distributed` rank that started a process of its own (as megatron-core's checkpoint writer
    starts a multiprocessing manager) and sleeps."""
    subprocess.Popen(["sleep", str(seconds)])
    time.sleep(seconds)
