"""The rollout phase on the driver: prompts → a rollout function (`megarl.rollout`: single turn or
the agent loop) → samples → scores, with DAPO's dynamic sampling and overlong shaping on top of either
when configured."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from megarl.algorithms.dapo import DynamicSampler, overlong_penalty
from megarl.cluster.metric_reduce import reduce_metrics
from megarl.cluster.timing import PhaseTimer
from megarl.config.config import Config
from megarl.config.rollout import response_length
from megarl.data import Prompt, iter_batches, reward_columns
from megarl.rewards.failure_window import FailureWindow
from megarl.rewards.scorer import RewardResult, RewardScorer
from megarl.rollout import Samples, offset_seed
from megarl.rollout.carry import CarryOver, RolloutFn
from megarl.workers.rollout.base import SamplingConfig


def score(
    samples: Samples, scorer: RewardScorer, decode: Callable[[list[int]], str]
) -> tuple[torch.Tensor, RewardResult]:
    """`[N]` sequence-level rewards of the samples, and the scorer's result (its error counts, the first
    failure). A multi-turn
    sample's response is its last turn (the answer), and the function also gets the `trajectory`
    column: each sample's messages after the prompt (turns, tool calls, observations)."""
    responses = [
        decode(t.final_turn if t is not None else ids) for ids, t in zip(samples.response_ids, samples.trajectories)
    ]
    columns = reward_columns(samples.prompts)
    if any(t is not None for t in samples.trajectories):
        columns["trajectory"] = [t.messages for t in samples.trajectories]
    result = scorer([p.text for p in samples.prompts], responses, **columns)
    return torch.tensor(result.scores, dtype=torch.float32), result


class RolloutPhase:
    """Produces one training step's samples and their sequence-level rewards."""

    def __init__(
        self,
        config: Config,
        rollout: RolloutFn,
        scorer: RewardScorer,
        decode: Callable[[list[int]], str],
        next_prompts: Callable[[], list[Prompt]],
        timer: PhaseTimer,
        carry: CarryOver | None = None,
    ):
        """`carry`: the training rounds' rollout with `rollout.over_sampling` (validation and ReMax's greedy
        baselines generate exactly their prompts with `rollout`)."""
        self.timer = timer
        self.config = config
        self.rollout = rollout
        self.carry = carry
        reward = config.reward
        self.failures = FailureWindow(
            reward.function, max_fraction=reward.max_failed_fraction, steps=reward.failure_window
        )
        """The failure-rate limit over training rounds (a DAPO step's extra rounds count as steps)."""
        self.scorer = scorer
        self.decode = decode
        self.next_prompts = next_prompts

    def __call__(self, sampling: SamplingConfig, step: int) -> tuple[Samples, torch.Tensor, dict]:
        algo = self.config.algorithm
        if not algo.dynamic_sampling.enable:
            return self._round(sampling, f"{step}.0")
        sampler = DynamicSampler(self.config.data.train_batch_size, algo.dynamic_sampling.max_rounds)
        samples_per_round = self.config.data.train_batch_size * sampling.n
        kept, kept_scores, round_metrics = [], [], []
        while not sampler.done:
            round_sampling = offset_seed(sampling, sampler.rounds * samples_per_round)
            samples, scores, metrics = self._round(round_sampling, f"{step}.{sampler.rounds}")
            keep = sampler.add(samples.index, scores)
            kept.append(samples.select(keep.tolist()))
            kept_scores.append(scores[keep])
            round_metrics.append(metrics)
        metrics = reduce_metrics(round_metrics) | {
            "dapo/rounds": float(sampler.rounds),
            "dapo/groups_kept_ratio": sampler.groups_kept / sampler.groups_seen,
        }
        return Samples.concat(kept), torch.cat(kept_scores), metrics

    def greedy_baseline(self, samples: Samples, sampling: SamplingConfig) -> torch.Tensor:
        """ReMax's baseline, `[N]`: the reward of the greedy response to each sample's prompt (one
        greedy sample per prompt from the same engines, scored like the samples)."""
        first_row: dict[str, int] = {}
        for row, group in enumerate(samples.index):
            first_row.setdefault(group, row)
        prompts = [samples.prompts[row] for row in first_row.values()]
        with self.timer("rollout"):
            greedy = self.rollout(prompts, replace(sampling, n=1, greedy=True, seed=None), "baseline")
        with self.timer("reward"):
            scores, _ = self._score(greedy, counted=False)
        by_group = dict(zip(first_row, scores.tolist()))
        return torch.tensor([by_group[group] for group in samples.index])

    def validation(self, prompts: Sequence[Prompt], sampling: SamplingConfig, batch_size: int) -> dict[str, float]:
        """`val/reward/mean` and `val/response_length/mean` of `prompts`, generated `batch_size` at a time."""
        samples = Samples.concat([self.rollout(chunk, sampling, "val") for chunk in iter_batches(prompts, batch_size)])
        scores, _ = score(samples, self.scorer, self.decode)  # validation: not in the failure-rate limit
        return {
            "val/reward/mean": scores.mean().item(),
            "val/response_length/mean": sum(map(len, samples.response_ids)) / len(samples),
        }

    def _round(self, sampling: SamplingConfig, group_prefix: str) -> tuple[Samples, torch.Tensor, dict]:
        with self.timer("rollout"):
            samples = (self.carry or self.rollout)(self.next_prompts(), sampling, group_prefix)
        with self.timer("reward"):
            scores, metrics = self._score(samples)
        return samples, scores, metrics | (self.carry.metrics if self.carry else {})

    def _score(self, samples: Samples, counted: bool = True) -> tuple[torch.Tensor, dict]:
        scores, result = score(samples, self.scorer, self.decode)
        metrics = result.metrics
        if counted:
            self.failures.add(int(metrics["reward/failed_samples"]), len(samples), result.first_error)
        overlong = self.config.algorithm.overlong
        if overlong.enable:
            lengths = torch.tensor([len(r) for r in samples.response_ids])
            scores = scores + overlong_penalty(
                lengths, response_length(self.config.rollout), overlong.buffer_length, overlong.penalty_factor
            )
        return scores, metrics
