"""SIGINT / SIGTERM during a run: one line and the shell's exit code (130 / 143), not a traceback.

    with StopOnSignal(where):           # the first SIGINT or SIGTERM raises Stopped in the main thread,
        trainer.fit()                     # ... whose clean-up (Ray, workers, reward processes) then runs in full
    # except Stopped as stopped:  print(stopped_line(...)); return stopped.exit_code

`where()` is called as the signal arrives (before any clean-up unwinds it) and travels as `Stopped.where`.

After the first signal both are ignored, so a second Ctrl-C cannot cut the clean-up short and leave
worker processes behind.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """A stop signal arrived."""

    def __init__(self, signum: int, where: object):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.where = where
        """What the run was doing when the signal came (the `where()` of `StopOnSignal`)."""

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended (130, 143)."""
        return 128 + self.signum


class StopOnSignal:
    """Turns the first SIGINT or SIGTERM into `Stopped`; restores the previous handlers on exit."""

    def __init__(self, where: Callable[[], object]):
        self.where = where

    def __enter__(self) -> StopOnSignal:
        self.previous = {signum: signal.signal(signum, self._raise) for signum in SIGNALS}
        return self

    def _raise(self, signum: int, frame) -> None:
        for other in SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        raise Stopped(signum, self.where())

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def stopped_line(command: str, stopped: Stopped, checkpoint) -> str:
    """`megarl train: stopped by SIGTERM during step 8 (update_actor); last checkpoint: step 6 (...);
    continue ... checkpoint.resume=auto`. `stopped.where`: (step or None, the phases being timed);
    `checkpoint`: the latest complete one (`.step`, `.path`) or None."""
    step, phases = stopped.where
    doing = "start-up" if step is None else f"step {step}" + (f" ({phases[-1]})" if phases else "")
    if checkpoint is None:
        saved = "no checkpoint was saved; a new run starts from the beginning"
    else:
        saved = (f"last checkpoint: step {checkpoint.step} ({checkpoint.path}); continue from it by running the "
                 "same command with checkpoint.resume=auto")
    return f"megarl {command}: stopped by {stopped} during {doing}; {saved}"
