"""Checking a sync: the rollout engine's prompt log-probs on a small fixed probe batch must equal
the actor's. The gap is a metric every step; over the threshold it is an error that names the
layout pair and, when the trainer side found one, the Megatron parameter that converted wrongly.

    probe = probe_token_ids(dims.vocab_size)
    actor = actor_probe_logprobs(actor, probe)          # every trainer rank (megarl.workers.sync_probe)
    metrics = check_sync(engine.prompt_logprobs(probe), actor, threshold=1e-4, layout=plan.layout)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.bridge.plan import LayoutPair

PROBE_SEQUENCES = 4
PROBE_LENGTH = 16


class SyncVerificationError(RuntimeError):
    """The rollout engine's log-probs differ from the actor's by more than the threshold after a sync."""


def probe_token_ids(vocab_size: int, *, sequences: int = PROBE_SEQUENCES, seed: int = 0) -> list[list[int]]:
    """`sequences` fixed sequences of `PROBE_LENGTH` token ids, the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (sequences, PROBE_LENGTH), generator=generator).tolist()


def logprob_gap(engine_logprobs: Sequence[torch.Tensor], actor_logprobs: torch.Tensor) -> dict[str, float]:
    """`sync/logprob_max_abs_diff` and `sync/logprob_mean_abs_diff` between the engine's per-sequence
    `[T-1]` log-probs and the actor's `[B, T-1]`."""
    diff = (torch.stack(list(engine_logprobs)).float() - actor_logprobs.float()).abs()
    return {"sync/logprob_max_abs_diff": diff.max().item(), "sync/logprob_mean_abs_diff": diff.mean().item()}


def check_sync(
    engine_logprobs: Sequence[torch.Tensor],
    actor_logprobs: torch.Tensor,
    *,
    threshold: float,
    layout: LayoutPair,
    suspects: Sequence[str] = (),
) -> dict[str, float]:
    """The gap metrics; raises `SyncVerificationError` when the max gap exceeds `threshold`.
    `suspects`: Megatron parameters the trainer found converting wrongly (`WeightSender.conversion_errors`)."""
    metrics = logprob_gap(engine_logprobs, actor_logprobs)
    gap = metrics["sync/logprob_max_abs_diff"]
    if not gap <= threshold:  # NaN fails too
        where = (
            f"parameters that do not convert back to the actor's shards: {', '.join(suspects)}"
            if suspects
            else "every parameter converts back to the actor's shards exactly, so the loss is on the "
            "receiving side (names, the engine's loader, its dtype) or the engine missed the sync"
        )
        raise SyncVerificationError(
            f"weight sync {layout}: rollout log-probs differ from the actor's by {gap:.3g} "
            f"(mean {metrics['sync/logprob_mean_abs_diff']:.3g}) > threshold {threshold:g}; {where}"
        )
    return metrics
