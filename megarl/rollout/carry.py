"""Groups carried between steps (`rollout.over_sampling`, async with partial rollouts): `extra` prompts' groups
more than a batch needs stay in flight, a call returns the first `len(prompts)` groups to finish, and the others,
finished or not, go on in the next call's generation beside its new prompts, their tokens, log-probs and weight
versions kept (AReaL's `max_concurrent_rollouts`, slime's over-sampling). What is in flight and how it is
generated is the rollout's: single-turn rows (`megarl.rollout.partial.RowsInFlight`) or the agent loop's
trajectories (`megarl.rollout.multi_turn.TrajectoriesInFlight`).

    rows = RowsInFlight(engines, 32, stream.between_segments)
    exact = partial(partial_single_turn, engines, 32, stream.between_segments)
    carry = CarryOver(rows, exact, stream.oldest_allowed_version, next_prompts, extra=4)
    batch = carry(prompts, sampling, "7.0")  # len(prompts) groups: the first to finish of those in flight
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from megarl.data import Prompt
from megarl.rollout.samples import Samples
from megarl.workers.rollout.base import SamplingConfig

RolloutFn = Callable[[Sequence[Prompt], SamplingConfig, str], Samples]
"""`(prompts, sampling, group_prefix) -> Samples`: a rollout of exactly its prompts."""


def stale_groups(versions: Iterable[tuple[str, Sequence[int]]], oldest_allowed: int) -> set[str]:
    """The groups holding a token sampled by weights older than `oldest_allowed`: `versions` pairs a group with
    the weight versions of one of its samples' tokens (a group may come in several pairs; no token, not stale)."""
    return {group for group, seen in versions if min(seen, default=oldest_allowed) < oldest_allowed}


class InFlight(Protocol):
    """What a rollout keeps in flight between two calls: groups of `sampling.n` samples each."""

    def start(self, prompts: Sequence[Prompt], sampling: SamplingConfig, group_prefix: str, first: int) -> None:
        """New groups, nothing generated yet: prompt i's is `{group_prefix}/{first + i}`."""

    def restart_stale(self, oldest_allowed: int) -> int:
        """The groups holding a token sampled by weights older than `oldest_allowed` start over from their
        prompts; how many did."""

    def run(self, sampling: SamplingConfig, enough: Callable[[], bool]) -> None:
        """Generate until every group ended or `enough()` (asked between two segments or turns)."""

    def finished_groups(self, sampling: SamplingConfig) -> list[str]:
        """The groups whose samples all ended, in the order they were started."""

    def take(self, groups: set[str]) -> Samples:
        """The samples of `groups` (finished), which leave the flight."""

    def groups(self) -> int:
        """Groups in flight."""


class CarryOver:
    """`rollout.over_sampling`: a call returns the first `len(prompts)` groups to finish, in the order they were
    started, and carries the others into the next call. The first call tops the groups in flight up from
    `more_prompts` (the data loader's next batch); prompts not started yet wait, in order, in `spare`.

    A carried group whose oldest token is older than `oldest_allowed()` (the batch being made would be more than
    `trainer.max_staleness` versions stale with it) starts over from its prompt (`rollout/restarted_groups`):
    never trained on stale. A call made while another is suspended between two segments (the trainer making a
    stale batch again, `AsyncRolloutStream.take`) is `exact`'s: exactly its prompts, carrying nothing."""

    def __init__(
        self,
        flight: InFlight,
        exact: RolloutFn,
        oldest_allowed: Callable[[], int],
        more_prompts: Callable[[], list[Prompt]],
        extra: int,
    ):
        self.flight = flight
        self.exact = exact
        self.oldest_allowed = oldest_allowed
        self.more_prompts = more_prompts
        self.extra = extra
        self.spare: list[Prompt] = []
        self.started = 0
        """Groups started so far: the next one is numbered this in its group id."""
        self.busy = False
        self.metrics: dict[str, float] = {}
        """The last call's `rollout/carried_groups` and `rollout/restarted_groups`."""

    def __call__(self, prompts: Sequence[Prompt], sampling: SamplingConfig, group_prefix: str) -> Samples:
        if self.busy:
            self.metrics = {}  # nothing carried in this call: the suspended call's counts are not its own
            return self.exact(prompts, sampling, group_prefix)
        self.busy = True
        try:
            return self._batch(prompts, sampling, group_prefix)
        finally:
            self.busy = False

    def carried_groups(self) -> int:
        """Groups in flight between two calls (lost when the run stops)."""
        return self.flight.groups()

    def _batch(self, prompts: Sequence[Prompt], sampling: SamplingConfig, group_prefix: str) -> Samples:
        needed = len(prompts)
        self.spare += prompts
        while self.carried_groups() + len(self.spare) < needed + self.extra:
            self.spare += self.more_prompts()
        started = needed + self.extra - self.carried_groups()
        new, self.spare = self.spare[:started], self.spare[started:]
        # Numbered on from every group started before: a step's batch made again (`AsyncRolloutStream.take`)
        # has the same prefix as the first try, whose groups may still be carried.
        self.flight.start(new, sampling, group_prefix, self.started)
        self.started += len(new)
        restarted = self.flight.restart_stale(self.oldest_allowed())
        self.flight.run(sampling, lambda: len(self.flight.finished_groups(sampling)) >= needed)
        batch = self.flight.take(set(self.flight.finished_groups(sampling)[:needed]))
        self.metrics = {
            "rollout/carried_groups": float(self.carried_groups()),
            "rollout/restarted_groups": float(restarted),
        }
        return batch
