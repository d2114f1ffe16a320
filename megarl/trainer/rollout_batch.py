"""Rollout outputs → the tensors of a training step (pure; the driver's data movement).

Samples are kept prompt-major: the `n` samples of prompt `i` are rows `i*n .. i*n+n-1`, and
`index[row]` is the group id the advantage estimators normalise within.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.data import Prompt
from megarl.workers.batch import PolicyBatch
from megarl.workers.rollout.base import RolloutOutput


@dataclass
class Samples:
    """One step's rollouts, flattened to one entry per sample (prompt-major)."""

    prompts: list[Prompt]
    """The prompt of each sample (repeated `n` times)."""
    response_ids: list[list[int]]
    """Generated token ids of each sample (stop token included)."""
    rollout_log_probs: list[Tensor]
    """Per-token log-probs the engine sampled with, `[len(response)]` each."""
    finish_reasons: list[str]
    """"stop" or "length"."""
    index: list[str]
    """Group id of each sample (unique per prompt and rollout round)."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, keep: Sequence[bool]) -> Samples:
        rows = [i for i, k in enumerate(keep) if k]
        return Samples(*([getattr(self, f)[i] for i in rows] for f in self.__dataclass_fields__))

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        return Samples(*([x for part in parts for x in getattr(part, f)] for f in Samples.__dataclass_fields__))


def flatten_rollouts(prompts: Sequence[Prompt], outputs: Sequence[RolloutOutput], group_prefix: str) -> Samples:
    """`outputs[i]` holds the samples of `prompts[i]`."""
    samples = Samples([], [], [], [], [])
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for response, log_probs, finish in zip(
            output.response_token_ids, output.response_logprobs, output.finish_reasons, strict=True
        ):
            samples.prompts.append(prompt)
            samples.response_ids.append(list(response))
            samples.rollout_log_probs.append(log_probs)
            samples.finish_reasons.append(finish)
            samples.index.append(f"{group_prefix}/{i}")
    return samples


def policy_batch(samples: Samples, response_length: int) -> PolicyBatch:
    """Prompts left-padded to the longest prompt, responses right-padded to `response_length`
    (the rollout's `max_new_tokens`, so every step has the same width)."""
    rows = len(samples)
    prompt_length = max(len(p.token_ids) for p in samples.prompts)
    prompts = torch.zeros(rows, prompt_length, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_length, dtype=torch.bool)
    responses = torch.zeros(rows, response_length, dtype=torch.long)
    response_mask = torch.zeros(rows, response_length, dtype=torch.bool)
    rollout_log_probs = torch.zeros(rows, response_length)
    for row, (prompt, response, log_probs) in enumerate(
        zip(samples.prompts, samples.response_ids, samples.rollout_log_probs, strict=True)
    ):
        p, r = len(prompt.token_ids), len(response)
        prompts[row, prompt_length - p:] = torch.tensor(prompt.token_ids)
        prompt_mask[row, prompt_length - p:] = True
        responses[row, :r] = torch.tensor(response, dtype=torch.long)
        response_mask[row, :r] = True
        rollout_log_probs[row, :r] = log_probs.float()
    return PolicyBatch(
        prompts=prompts, prompt_mask=prompt_mask, responses=responses, response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
    )


def token_level_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    """`[B, R]`: each sample's score on its last response token (outcome reward), 0 elsewhere."""
    lengths = response_mask.sum(dim=1)
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    has_tokens = lengths > 0
    out[has_tokens, lengths[has_tokens] - 1] = scores[has_tokens].float()
    return out


def gather_by_dp(per_rank: Sequence[Tensor], grids: Sequence[dict[str, int]]) -> Tensor:
    """Concatenate one result per DP replica (taken from its TP 0 / first-stage rank), in DP order."""
    leaders = {g["dp_rank"]: result for g, result in zip(grids, per_rank) if g["tp_rank"] == 0 and g["pp_rank"] == 0}
    return torch.cat([leaders[d] for d in range(len(leaders))], dim=0)
