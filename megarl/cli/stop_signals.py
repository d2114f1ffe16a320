"""SIGINT / SIGTERM / SIGHUP during a run: one line and the shell's exit code (130 / 143 / 129), not a
traceback. SIGHUP (the terminal closed, or a login session ended) stops a run as cleanly as a
scheduler's SIGTERM: Python's default would end the driver at once and leave its workers behind.

    with StopOnSignal(where):   # the first stop signal requests a stop (`megarl.interrupt`),
        trainer.fit()           # which the driver raises at its next wait; fit's clean-up then runs in full
    # on any exception: if interrupt.requested(): print(stopped_line(...)); return its exit_code

`where()` is called as the signal arrives (before any clean-up unwinds it) and travels as `Stopped.where`.
After the first signal all three are ignored, so a second Ctrl-C cannot cut the clean-up short and
leave worker processes behind. `megarl train`, `sft`, `convert` and `bench` run under it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from megarl import interrupt
from megarl.interrupt import Stopped

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopOnSignal:
    """Turns the first of `SIGNALS` into a stop request; restores the previous handlers on exit."""

    def __init__(self, where: Callable[[], object]):
        self.where = where

    def __enter__(self) -> StopOnSignal:
        self.previous = {signum: signal.signal(signum, self._request) for signum in SIGNALS}
        return self

    def _request(self, signum: int, frame) -> None:
        for other in SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        interrupt.request(Stopped(signum, self.where()))

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def stopped_line(command: str, stopped: Stopped, checkpoint) -> str:
    """`megarl train: stopped by SIGTERM during step 8 (update_actor); last checkpoint: step 6 (...);
    continue ... checkpoint.resume=auto`. `stopped.where`: (step or None, the phases being timed);
    `checkpoint`: the latest complete one (`.step`, `.path`) or None."""
    return f"megarl {command}: stopped by {stopped} during {doing(*stopped.where)}; {resume_hint(checkpoint)}"


def doing(step: int | None, phases: list[str] | None) -> str:
    """`step 8 (update_actor)`, `step 8`, or `start-up` (`step` None): the step and its innermost phase."""
    return "start-up" if step is None else f"step {step}" + (f" ({phases[-1]})" if phases else "")


def resume_hint(checkpoint) -> str:
    """The latest complete checkpoint (`.step`, `.path`, or None) and how to continue from it."""
    if checkpoint is None:
        return "no checkpoint was saved; a new run starts from the beginning"
    return (
        f"last checkpoint: step {checkpoint.step} ({checkpoint.path}); continue from it by running the "
        "same command with checkpoint.resume=auto"
    )
