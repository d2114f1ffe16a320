"""Partial rollouts (`rollout.partial_rollout`, `trainer.rollout_mode: async`): single-turn generation in
segments of at most `segment` new tokens, so that a weight update waits for one segment, not for the
batch's longest response; and the rows carried from one step's generation into the next with
`rollout.over_sampling` (`RowsInFlight`, driven by `megarl.rollout.carry.CarryOver`).

Between two segments the rollout calls `between_segments()`, where the async stream lets a waiting
weight load in (`AsyncRolloutStream.between_segments`) and which returns the weight version the engines
hold now. Every sample is a row of its own (n = 1 per request, seeded `sampling.seed + k` for the k-th
row of the call's segments, so the first segment seeds sample j of prompt i `seed + i·n + j` as
`single_turn` does). A row a segment cut short (finish reason "length" below `sampling.max_new_tokens`)
goes on from where it stopped: its prompt and the tokens made so far are submitted again as the context of
the next segment (vLLM re-encodes the prefix; its prefix cache is reset at every weight load), capped at
what is left of the sample's length budget. Every token keeps the version of the weights that sampled it
(`Samples.token_versions`) and its log-prob under those weights, what the corrections need; with routing
replay, the experts each token was routed to by the segment that fed it first
(`megarl.rollout.samples.extend_routing`).

    samples = partial_single_turn(engines, 32, stream.between_segments, prompts, sampling, "7.0")
    rows = RowsInFlight(engines, 32, stream.between_segments)  # what a CarryOver keeps between its calls
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from megarl.data import Prompt
from megarl.orchestration.worker_group import WorkerGroup
from megarl.rollout.carry import stale_groups
from megarl.rollout.samples import Samples, extend_routing
from megarl.rollout.single_turn import generate_contexts
from megarl.workers.rollout.base import RolloutOutput, SamplingConfig


def partial_single_turn(
    engines: WorkerGroup,
    segment: int,
    between_segments: Callable[[], int],
    prompts: Sequence[Prompt],
    sampling: SamplingConfig,
    group_prefix: str,
) -> Samples:
    """`single_turn`'s samples, generated `segment` tokens at a time with a weight update allowed between
    two segments; `token_versions` set on every sample."""
    samples = fresh_rows(prompts, sampling.n, group_prefix)
    run_segments(engines, samples, segment, sampling, between_segments, lambda: not going_rows(samples, sampling))
    return samples


class RowsInFlight:
    """Single-turn rows carried from one call to the next (`megarl.rollout.carry.CarryOver`,
    `rollout.over_sampling`): every group's `n` rows together, generated in segments."""

    def __init__(self, engines: WorkerGroup, segment: int, between_segments: Callable[[], int]):
        self.engines = engines
        self.segment = segment
        self.between_segments = between_segments
        self.rows = Samples.empty()
        """The rows in flight, prompt-major, in the order their groups were started."""

    def start(self, prompts: Sequence[Prompt], sampling: SamplingConfig, group_prefix: str, first: int) -> None:
        self.rows = concat_rows(self.rows, fresh_rows(prompts, sampling.n, group_prefix, first))

    def restart_stale(self, oldest_allowed: int) -> int:
        return restart_stale(self.rows, oldest_allowed)

    def run(self, sampling: SamplingConfig, enough: Callable[[], bool]) -> None:
        run_segments(self.engines, self.rows, self.segment, sampling, self.between_segments, enough)

    def finished_groups(self, sampling: SamplingConfig) -> list[str]:
        return finished_groups(self.rows, sampling)

    def take(self, groups: set[str]) -> Samples:
        taken = self.rows.select([group in groups for group in self.rows.index])
        self.rows = self.rows.select([group not in groups for group in self.rows.index])
        return taken

    def groups(self) -> int:
        return len(group_rows(self.rows))


def fresh_rows(prompts: Sequence[Prompt], n: int, group_prefix: str, first: int = 0) -> Samples:
    """`n` rows per prompt, nothing generated yet; prompt i's group is `{group_prefix}/{first + i}`."""
    rows = [(first + i, prompt) for i, prompt in enumerate(prompts) for _ in range(n)]
    return Samples(
        prompts=[prompt for _, prompt in rows],
        response_ids=[[] for _ in rows],
        rollout_log_probs=[torch.zeros(0) for _ in rows],
        loss_masks=[torch.zeros(0, dtype=torch.bool) for _ in rows],
        finish_reasons=["length"] * len(rows),
        index=[f"{group_prefix}/{i}" for i, _ in rows],
        trajectories=[None] * len(rows),
        token_versions=[[] for _ in rows],
    )


def concat_rows(carried: Samples, new: Samples) -> Samples:
    """`carried` then `new`; rows that have no routing yet get None beside rows that have some."""
    if (carried.routed_experts is None) != (new.routed_experts is None):
        for part in (carried, new):
            part.routed_experts = part.routed_experts or [None] * len(part)
    return Samples.concat([carried, new])


def going_rows(samples: Samples, sampling: SamplingConfig) -> list[int]:
    """Rows a segment cut short: below the length budget, no stop token yet (fresh rows among them)."""
    return [
        row
        for row, (ids, finish) in enumerate(zip(samples.response_ids, samples.finish_reasons, strict=True))
        if finish == "length" and len(ids) < sampling.max_new_tokens
    ]


def group_rows(samples: Samples) -> dict[str, list[int]]:
    """Each group's rows, groups in the order of their first row."""
    groups: dict[str, list[int]] = {}
    for row, group in enumerate(samples.index):
        groups.setdefault(group, []).append(row)
    return groups


def finished_groups(samples: Samples, sampling: SamplingConfig) -> list[str]:
    """The groups none of whose rows goes on, in row order."""
    going = {samples.index[row] for row in going_rows(samples, sampling)}
    return [group for group in group_rows(samples) if group not in going]


def restart_stale(samples: Samples, oldest_allowed: int) -> int:
    """Rows of groups holding a token sampled by weights older than `oldest_allowed` start over from their
    prompt; how many groups did."""
    stale = stale_groups(zip(samples.index, samples.token_versions, strict=True), oldest_allowed)
    for row in (row for row, group in enumerate(samples.index) if group in stale):
        samples.response_ids[row], samples.token_versions[row] = [], []
        samples.rollout_log_probs[row], samples.loss_masks[row] = torch.zeros(0), torch.zeros(0, dtype=torch.bool)
        samples.finish_reasons[row] = "length"
        if samples.routed_experts is not None:
            samples.routed_experts[row] = None
    return len(stale)


def run_segments(
    engines: WorkerGroup,
    samples: Samples,
    segment: int,
    sampling: SamplingConfig,
    between_segments: Callable[[], int],
    enough: Callable[[], bool],
) -> None:
    """Segments over every row that goes on until `enough()`; each preceded by `between_segments()` and
    generated with the version it returns. `rollout.min_new_tokens` holds in a segment of fresh rows only
    (validate: partial rollouts make it in their first segment; over-sampling refuses it)."""
    drawn = 0
    while not enough():
        version = between_segments()
        rows = going_rows(samples, sampling)
        fresh = [not samples.response_ids[row] for row in rows]
        assert all(fresh) or not any(fresh) or sampling.min_new_tokens == 0, "validate: over_sampling needs 0"
        contexts = [[*samples.prompts[row].token_ids, *samples.response_ids[row]] for row in rows]
        left = [sampling.max_new_tokens - len(samples.response_ids[row]) for row in rows]
        outputs = generate_contexts(
            engines,
            contexts,
            replace(sampling, n=1, min_new_tokens=sampling.min_new_tokens if all(fresh) else 0),
            max_new_tokens=[min(segment, n) for n in left],
            seeds=None if sampling.seed is None else [sampling.seed + drawn + k for k in range(len(rows))],
        )
        drawn += len(rows)
        for row, output in zip(rows, outputs, strict=True):
            _extend(samples, row, output, version)


def _extend(samples: Samples, row: int, output: RolloutOutput, version: int) -> None:
    """Sample `row` goes on with `output`'s one sample (its tokens, their log-probs, how they ended and, with
    routing replay, the routing of the tokens it fed first) sampled by weights of `version`."""
    ids = output.response_token_ids[0]
    samples.response_ids[row] = [*samples.response_ids[row], *ids]
    samples.rollout_log_probs[row] = torch.cat([samples.rollout_log_probs[row], output.response_logprobs[0].float()])
    samples.loss_masks[row] = torch.ones(len(samples.response_ids[row]), dtype=torch.bool)
    samples.finish_reasons[row] = output.finish_reasons[0]
    samples.token_versions[row] = [*samples.token_versions[row], *[version] * len(ids)]
    if output.routed_experts:
        if samples.routed_experts is None:
            samples.routed_experts = [None] * len(samples)
        samples.routed_experts[row] = extend_routing(samples.routed_experts[row], output.routed_experts[0])
