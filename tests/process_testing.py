"""Waiting for processes the tests killed (shared by the reward and tool isolation tests)."""

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
