"""Rollout samples → the tensors of a training step (pure; the driver's data movement)."""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.rollout.samples import Samples
from megarl.workers.batch import PolicyBatch


def policy_batch(samples: Samples, response_length: int) -> PolicyBatch:
    """Prompts left-padded to the longest prompt, responses right-padded to `response_length`
    (`config.rollout.response_length`, so every step has the same width); the response mask is each
    sample's loss mask (False on tool observations and padding); the engines' log-probs, which the
    actor's mismatch metrics (every step) and correction read; the experts the engines routed each
    token to, when they returned them (`PolicyBatch.routed_experts`: -1 on padding and on each sample's
    last token, which the engine never fed back)."""
    rows = len(samples)
    prompt_length = max(len(p.token_ids) for p in samples.prompts)
    prompts = torch.zeros(rows, prompt_length, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_length, dtype=torch.bool)
    responses = torch.zeros(rows, response_length, dtype=torch.long)
    response_mask = torch.zeros(rows, response_length, dtype=torch.bool)
    engine_log_probs = torch.zeros(rows, response_length)
    for row, (prompt, response, log_probs, loss_mask) in enumerate(
        zip(samples.prompts, samples.response_ids, samples.rollout_log_probs, samples.loss_masks, strict=True)
    ):
        p, r = len(prompt.token_ids), len(response)
        prompts[row, prompt_length - p :] = torch.tensor(prompt.token_ids)
        prompt_mask[row, prompt_length - p :] = True
        responses[row, :r] = torch.tensor(response, dtype=torch.long)
        response_mask[row, :r] = loss_mask
        engine_log_probs[row, :r] = log_probs.float()
    return PolicyBatch(
        prompts=prompts,
        prompt_mask=prompt_mask,
        responses=responses,
        response_mask=response_mask,
        rollout_log_probs=engine_log_probs,
        routed_experts=None
        if samples.routed_experts is None
        else routed_columns(samples, prompt_length, response_length),
    )


def routed_columns(samples: Samples, prompt_length: int, response_length: int) -> Tensor:
    """`[B, P + R, L, k]` int16: each sample's routed experts (`[p + r - 1, L, k]`) at its tokens' columns of
    the batch (prompt left-padded to `P`, response right-padded to `R`), -1 elsewhere."""
    first = samples.routed_experts[0]
    out = torch.full((len(samples), prompt_length + response_length, *first.shape[1:]), -1, dtype=torch.int16)
    for row, (prompt, response, routed) in enumerate(
        zip(samples.prompts, samples.response_ids, samples.routed_experts, strict=True)
    ):
        p, r = len(prompt.token_ids), len(response)
        if routed.shape[0] != p + r - 1:
            raise ValueError(
                f"sample {row}: the engine routed {routed.shape[0]} tokens, expected prompt {p} + response {r} - 1"
            )
        out[row, prompt_length - p : prompt_length + r - 1] = routed
    return out


def token_level_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    """`[B, R]`: each sample's score on its last token in the loss mask (outcome reward; multi-turn: the
    last token the model wrote), 0 elsewhere."""
    positions = torch.arange(1, response_mask.shape[1] + 1)
    last = (response_mask * positions).max(dim=1).values  # 1-based; 0: nothing to put the score on
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    has_tokens = last > 0
    out[has_tokens, last[has_tokens] - 1] = scores[has_tokens].float()
    return out
