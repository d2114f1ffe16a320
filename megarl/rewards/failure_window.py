"""The reward failure-rate limit (`reward.max_failed_fraction` over `reward.failure_window` steps): a
reward function that keeps failing stops the run, naming itself and its first error, instead of
training to the end on rewards of 0.

    window = FailureWindow("my_rewards:score", max_fraction=0.5, steps=10)
    window.add(failed=12, total=128, first_error=None)   # once per training step; raises past the limit
"""

from __future__ import annotations

from collections import deque

from megarl.rewards.functions import RewardFunctionError


class FailureWindow:
    """Failed and scored responses of the last `steps` training steps."""

    def __init__(self, spec: str, *, max_fraction: float, steps: int):
        self.spec = spec
        self.max_fraction = max_fraction
        self.steps: deque[tuple[int, int]] = deque(maxlen=steps)
        """(failed, total) of each step in the window, oldest first."""
        self.first_error: str | None = None
        """The first failure's report in the window's run (kept for the stop message)."""

    def add(self, failed: int, total: int, first_error: str | None) -> None:
        """Count one step; `RewardFunctionError` when the window's failed share passes the limit."""
        self.steps.append((failed, total))
        self.first_error = self.first_error or first_error
        failed_all, total_all = (sum(column) for column in zip(*self.steps))
        if total_all and failed_all / total_all > self.max_fraction:
            raise RewardFunctionError(
                f"reward.function {self.spec!r} failed on {failed_all} of the {total_all} responses of the last "
                f"{len(self.steps)} step(s) ({failed_all / total_all:.0%} > reward.max_failed_fraction = "
                f"{self.max_fraction}); they were scored 0. The first error:\n{(self.first_error or '').rstrip()}\n"
                "Fix the function (or raise reward.timeout_s if it only needs more time)"
            )
