"""A stop that a signal asked for, taken at the driver's next wait.

The signal handler only records the request (`request`); the driver raises it at points it controls
(`check`: every second while it waits on its workers, and between steps). Raised wherever the signal
lands instead, the exception could end up inside a library that logs or wraps it (Ray's
deserialisation logs it with a traceback and returns a RaySystemError) or swallows it.

    interrupt.request(Stopped(signal.SIGTERM, where))   # in the handler
    interrupt.check()                                   # raises the Stopped once one is requested
"""

from __future__ import annotations

import signal

POLL_S = 1.0
"""How often a driver blocked on its workers looks for a stop request."""


class Stopped(Exception):
    """A stop signal arrived."""

    def __init__(self, signum: int, where: object):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.where = where
        """What the run was doing when the signal came."""

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended (130, 143)."""
        return 128 + self.signum


_requested: Stopped | None = None


def request(stopped: Stopped) -> None:
    """Record a stop (the first one counts)."""
    global _requested
    _requested = _requested or stopped


def requested() -> Stopped | None:
    return _requested


def check() -> None:
    """Raise the requested stop, if any."""
    if _requested is not None:
        raise _requested
