"""One response per sample: the prompts go to the engines once (the rollout of plain GRPO/PPO/DAPO).

`generate_contexts` is the one way any rollout function reaches the engines: token ids in, token ids
and log-probs out, spread over the engines in contiguous chunks with the run's seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from megarl.data import Prompt
from megarl.orchestration.worker_group import WorkerGroup
from megarl.rollout.samples import Samples, flatten_rollouts
from megarl.workers.rollout.base import RolloutOutput, SamplingConfig


def offset_seed(sampling: SamplingConfig, offset: int) -> SamplingConfig:
    """`sampling` with its seed moved by `offset` (unseeded stays unseeded)."""
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + offset)


def generate_contexts(
    engines: WorkerGroup,
    contexts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    max_new_tokens: Sequence[int] | None = None,
    seeds: Sequence[int] | None = None,
) -> list[RolloutOutput]:
    """`sampling.n` samples of each context (token ids), in order. Sample j of context i is seeded
    `sampling.seed + i·n + j` whichever engine it lands on: an engine seeds sample j of its k-th
    context `seed + k·n + j` (`megarl.workers.rollout.base.prompt_seeds`), so each chunk's seed is offset by its
    first context. `max_new_tokens`: a cap per context (default `sampling.max_new_tokens`); `seeds`:
    a seed per context instead (sample j of context i: `seeds[i] + j`; the agent loop's turns), given
    with `max_new_tokens`."""
    count = engines.world_size
    bounds = [len(contexts) * k // count for k in range(count + 1)]
    args = []
    for k in range(count):
        part = slice(bounds[k], bounds[k + 1])
        chunk = [list(ids) for ids in contexts[part]]
        chunk_sampling = offset_seed(sampling, bounds[k] * sampling.n)
        per_context = [list(values[part]) for values in (max_new_tokens, seeds) if values is not None]
        args.append((chunk, chunk_sampling, *per_context))
    return [out for per_engine in engines.call_each("generate", args) for out in per_engine]


def single_turn(
    engines: WorkerGroup, prompts: Sequence[Prompt], sampling: SamplingConfig, group_prefix: str
) -> Samples:
    """`sampling.n` responses per prompt; samples in prompt order, every response token the model's."""
    outputs = generate_contexts(engines, [p.token_ids for p in prompts], sampling)
    return flatten_rollouts(prompts, outputs, group_prefix)
