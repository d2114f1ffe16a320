"""Partial rollouts (`rollout.partial_rollout`, `trainer.rollout_mode: async`): single-turn generation in
segments of at most `segment` new tokens, so that a weight update waits for one segment, not for the
batch's longest response.

Between two segments the rollout calls `between_segments()`, where the async stream lets a waiting
weight load in (`AsyncRolloutStream.between_segments`) and which returns the weight version the engines
hold now. A sample a segment cut short (finish reason "length" below `sampling.max_new_tokens`) goes on
from where it stopped: its prompt and the tokens made so far are submitted again as the context of the
next segment (vLLM re-encodes the prefix; its prefix cache is reset at every weight load), n = 1,
capped at what is left of the sample's length budget. Every token keeps the version of the weights that
sampled it (`Samples.token_versions`) and its log-prob under those weights, what the corrections need;
with routing replay, the experts each token was routed to by the segment that fed it first
(`megarl.rollout.samples.extend_routing`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from megarl.data import Prompt
from megarl.orchestration.worker_group import WorkerGroup
from megarl.rollout.samples import Samples, extend_routing, flatten_rollouts
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
    cap = sampling.max_new_tokens
    version = between_segments()
    first = generate_contexts(
        engines, [p.token_ids for p in prompts], replace(sampling, max_new_tokens=min(segment, cap))
    )
    samples = flatten_rollouts(prompts, first, group_prefix)
    samples.token_versions = [[version] * len(ids) for ids in samples.response_ids]
    for turn in range(1, -(-cap // segment)):
        going = [
            row
            for row, (ids, finish) in enumerate(zip(samples.response_ids, samples.finish_reasons))
            if finish == "length" and len(ids) < cap
        ]
        if not going:
            break
        version = between_segments()
        contexts = [[*samples.prompts[row].token_ids, *samples.response_ids[row]] for row in going]
        left = [cap - len(samples.response_ids[row]) for row in going]
        # A seed per segment of a sample (the contexts differ, so a seed the next step's block also holds
        # samples something else); min_new_tokens <= segment (validate): the first segment honoured it.
        seeds = None if sampling.seed is None else [sampling.seed + turn * len(samples) + row for row in going]
        outputs = generate_contexts(
            engines,
            contexts,
            replace(sampling, n=1, min_new_tokens=0, max_new_tokens=segment),
            max_new_tokens=[min(segment, n) for n in left],
            seeds=seeds,
        )
        for row, output in zip(going, outputs, strict=True):
            _extend(samples, row, output, version)
    return samples


def _extend(samples: Samples, row: int, output: RolloutOutput, version: int) -> None:
    """Sample `row` goes on with `output`'s one sample (its tokens, their log-probs, how they ended and, with
    routing replay, the routing of the tokens it fed first) sampled by weights of `version`."""
    ids = output.response_token_ids[0]
    samples.response_ids[row] = [*samples.response_ids[row], *ids]
    samples.rollout_log_probs[row] = torch.cat([samples.rollout_log_probs[row], output.response_logprobs[0].float()])
    samples.loss_masks[row] = torch.ones(len(samples.response_ids[row]), dtype=torch.bool)
    samples.finish_reasons[row] = output.finish_reasons[0]
    samples.token_versions[row] = [*samples.token_versions[row], *[version] * len(ids)]
    if samples.routed_experts is not None:
        samples.routed_experts[row] = extend_routing(samples.routed_experts[row], output.routed_experts[0])
