"""DAPO's data-side pieces (Yu et al. 2025): dynamic sampling, overlong reward shaping and overlong
filtering (samples cut at the length limit leave the policy loss: `truncated_samples`, `filtered_loss_mask`).

Dynamic sampling drops prompt groups whose rewards are all equal (every group-relative advantage
would be 0, so they only dilute the batch) and rolls out more prompts until the step has the
requested number of groups. `dynamic_sampling_mask` is the pure filter; `DynamicSampler` keeps
count across rollout rounds for the trainer:

    sampler = DynamicSampler(groups_per_step=16, max_rounds=4)
    kept = []
    while not sampler.done:
        batch = rollout(next_prompts())           # complete groups, ids unique across rounds
        keep = sampler.add(batch.index, batch.scores)   # raises once max_rounds is spent
        kept.append(batch[keep])
    batch = concat(kept)                          # exactly 16 groups

A group of one sample is dropped too: it has no baseline, its advantage is 0 (verl keeps it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from megarl.algorithms.advantages import group_ids


def dynamic_sampling_mask(index: Sequence[Hashable], rewards: torch.Tensor) -> torch.Tensor:
    """Which samples belong to groups with some reward variation.

    Args:
        index: `[B]` group id of each sample.
        rewards: `[B]` sequence-level reward (score) of each sample.

    Returns:
        `[B]` bool: True for samples of groups whose rewards are not all equal.
    """
    rewards = torch.as_tensor(rewards)
    groups, keys = group_ids(index, len(rewards))
    num_groups = len(keys)
    # Exact comparison: "all equal" means max == min; a tolerance would silently drop groups with
    # small but real differences (e.g. partial-credit rewards).
    group_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce_(
        0, groups, rewards.double(), "amax"
    )
    group_min = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(
        0, groups, rewards.double(), "amin"
    )
    return (group_max > group_min)[groups]


class DynamicSampler:
    """Counts kept groups across rollout rounds of one training step (see the module docstring).

    Raises when `max_rounds` rounds have not produced `groups_per_step` groups with reward
    variation, rather than training on a smaller batch: a silently shrinking batch changes the
    effective learning rate and hides that the task is too easy or too hard for the policy.
    """

    def __init__(self, groups_per_step: int, max_rounds: int):
        """
        Args:
            groups_per_step: prompt groups the step needs.
            max_rounds: rollout rounds allowed for one step, the first one included
                (`algorithm.dynamic_sampling.max_rounds`).
        """
        if groups_per_step < 1 or max_rounds < 1:
            raise ValueError(
                f"dynamic sampling needs groups_per_step >= 1 and max_rounds >= 1, "
                f"got groups_per_step={groups_per_step}, max_rounds={max_rounds}"
            )
        self.groups_per_step = groups_per_step
        self.max_rounds = max_rounds
        self.rounds = 0
        """Rollout rounds seen so far."""
        self.groups_seen = 0
        """Groups rolled out so far, kept or not (groups_kept / groups_seen is a useful metric)."""
        self._kept_ids: set[Hashable] = set()

    @property
    def groups_kept(self) -> int:
        """Groups kept so far (never more than `groups_per_step`)."""
        return len(self._kept_ids)

    @property
    def done(self) -> bool:
        """True once the step has all its groups."""
        return self.groups_kept == self.groups_per_step

    def add(self, index: Sequence[Hashable], rewards: torch.Tensor) -> torch.Tensor:
        """Filter one rollout round.

        Args:
            index: `[B]` group ids of this round; a kept id must not reappear in a later round
                (advantages would merge the two groups): make ids unique per round.
            rewards: `[B]` sequence-level rewards.

        Returns:
            `[B]` bool keep mask: samples of groups with reward variation, in order of first
            appearance, up to the groups the step still needs (extra groups are dropped whole).

        Raises:
            RuntimeError: this was round `max_rounds` and the step still lacks groups.
        """
        if self.done:
            raise RuntimeError("DynamicSampler.add called after the step already has all its groups")
        keep = dynamic_sampling_mask(index, rewards)
        groups, keys = group_ids(index, len(keep))
        group_keep = torch.zeros(len(keys), dtype=torch.bool).index_fill_(0, groups[keep], True)
        for number in group_keep.nonzero().flatten().tolist():
            if self.done:
                group_keep[number] = False
            elif keys[number] in self._kept_ids:
                raise ValueError(
                    f"group id {keys[number]!r} was already kept in an earlier rollout round; "
                    "give every round's groups fresh ids (e.g. include the round number)"
                )
            else:
                self._kept_ids.add(keys[number])
        self.rounds += 1
        self.groups_seen += len(keys)
        if not self.done and self.rounds >= self.max_rounds:
            raise RuntimeError(
                f"dynamic sampling kept {self.groups_kept} of {self.groups_per_step} groups after "
                f"{self.rounds} rollout rounds (algorithm.dynamic_sampling.max_rounds={self.max_rounds}); "
                f"{self.groups_seen - self.groups_kept} groups had all-equal rewards. Raise "
                "algorithm.dynamic_sampling.max_rounds, use prompts the policy sometimes solves and sometimes "
                "fails, or disable dynamic sampling"
            )
        return group_keep[groups]


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each sample's reward.

    0 for lengths up to `max_response_length - buffer_length`, then linear down to
    `-penalty_factor` at `max_response_length` (and `-penalty_factor` beyond it):

        penalty(L) = clip(-(L - (max - buffer)) / buffer * penalty_factor, -penalty_factor, 0)

    Args:
        response_lengths: `[B]` number of generated tokens of each sample.
        max_response_length: the rollout's max new tokens.
        buffer_length: width of the linear ramp (DAPO: 4096 of 20480).
        penalty_factor: penalty at the max length (DAPO: 1.0).

    Returns:
        `[B]` float penalties (<= 0).
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"overlong buffer_length must be in (0, max_response_length={max_response_length}], got {buffer_length}"
        )
    if penalty_factor < 0:
        raise ValueError(f"overlong penalty_factor must be >= 0 (it is subtracted), got {penalty_factor}")
    lengths = torch.as_tensor(response_lengths, dtype=torch.float32)
    ramp = ((lengths - (max_response_length - buffer_length)) / buffer_length).clamp(0.0, 1.0)
    return -penalty_factor * ramp


def truncated_samples(finish_reasons: Sequence[str]) -> torch.Tensor:
    """`[B]` bool: the samples cut at a length limit, by their rollout's finish reason ("length": the engine's
    max_new_tokens; a multi-turn trajectory's token budget or turn length), not those that stopped on their own."""
    return torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)


def filtered_loss_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering: `[B, R]` `response_mask` without the rows of the `[B]` `truncated`
    samples, so that they add nothing to the policy loss nor to its normaliser (their rewards still
    entered the group statistics of the advantages)."""
    return response_mask & ~truncated[:, None]
