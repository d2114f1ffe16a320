"""A role's micro-batch cut: its `max_tokens_per_micro_batch` with "auto" (the default) resolved.

    auto  -> micro_batch_size_per_gpu × S tokens, S = data.max_prompt_length + the response length (multi-turn:
             rollout.multi_turn.max_total_tokens), the longest sample the batch plan allows: the token slots of
             one padded micro-batch, so the same peak activation memory as padded micro-batches, filled with
             samples instead of padding; the losses and gradients are the same for any cut (the step's token
             counts normalise them, not the micro-batch's). Padded instead where packing to that budget is
             refused: a context-parallel role whose budget is no multiple of 2 × CP (× TP with sequence
             parallelism).
    N     -> packed micro-batches of at most N tokens per rank.
    null  -> padded micro-batches of `micro_batch_size_per_gpu` samples.

The batch plan holds the resolved budget (`RolePlan.max_tokens_per_micro_batch`); the trainer, the memory
estimate and `megarl validate`'s table read it from there or from here, never the raw setting.
"""

from __future__ import annotations

from megarl.config.config import Config
from megarl.config.role_checks import context_parallel_multiple
from megarl.config.rollout import response_length

AUTO = "auto"
"""The `max_tokens_per_micro_batch` setting resolved here."""


def token_budget(role_config, sample_tokens: int) -> int | None:
    """The token budget of the packed micro-batches of a role section (`config.actor`, `.critic`, `.ref`),
    or None for padded micro-batches. `sample_tokens`: S, the longest sample (`sample_token_bound`)."""
    budget = role_config.max_tokens_per_micro_batch
    if budget != AUTO:
        return budget
    slots = role_config.micro_batch_size_per_gpu * sample_tokens
    # Context parallelism cuts a micro-batch into 2 × CP chunks: a budget that does not split so stays padded.
    return slots if slots % context_parallel_multiple(role_config.parallel) == 0 else None


def sample_token_bound(config: Config) -> int:
    """S: the most tokens one sample (prompt + response) of `config` may have."""
    return config.data.max_prompt_length + response_length(config.rollout)
