"""The sync check's probe on the actor's side: the probe sequences (`megarl.bridge.verify.probe_token_ids`)
as a policy batch, and their log-probs under a `MegatronActor`, to compare with an engine's prompt
log-probs (`megarl.bridge.verify.check_sync`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.workers.batch import PolicyBatch


def probe_policy_batch(token_ids: Sequence[Sequence[int]]) -> PolicyBatch:
    """The probe as a `PolicyBatch` whose responses are tokens 1..T-1 of each sequence: the actor's
    response log-probs are then exactly `RolloutEngine.prompt_logprobs` (`[B, T-1]`)."""
    tokens = torch.tensor(token_ids, dtype=torch.long)  # [B, T]
    prompts, responses = tokens[:, :1], tokens[:, 1:]
    return PolicyBatch(
        prompts=prompts,
        prompt_mask=torch.ones_like(prompts, dtype=torch.bool),
        responses=responses,
        response_mask=torch.ones_like(responses, dtype=torch.bool),
    )


def actor_probe_logprobs(actor, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """`[B, T-1]` log-probs of the probe under a `MegatronActor` (collective over its ranks), one sequence per
    micro-batch: megatron's interleaved schedule (virtual pipeline stages) needs at least PP micro-batches."""
    log_probs, _ = actor.compute_log_prob(probe_policy_batch(token_ids), micro_batch_size=1)
    return log_probs.float()
