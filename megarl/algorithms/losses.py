"""Loss aggregation: one `[B, T]` matrix of per-token losses -> one scalar.

The modes and their numbers follow verl's `agg_loss`:

| mode                      | full-batch value                                   | normaliser N            |
|---------------------------|----------------------------------------------------|-------------------------|
| `token-mean`              | sum_{i,t} m_it l_it / N                            | valid tokens            |
| `seq-mean-token-sum`      | sum_i (sum_t m_it l_it) / N                        | non-empty sequences     |
| `seq-mean-token-mean`     | sum_i (sum_t m_it l_it / sum_t m_it) / N           | non-empty sequences     |
| `seq-mean-token-sum-norm` | sum_i (sum_t m_it l_it) / (N * loss_scale_factor)  | non-empty sequences     |

(`m` = loss mask, `l` = loss matrix; a non-empty sequence has at least one valid token.)
`seq-mean-token-sum-norm` is Dr. GRPO's aggregation: token sums divided by a constant length
(`loss_scale_factor`, default `T`) instead of each sequence's own length, averaged over sequences
(`mean(seq_losses) / C`, current verl's definition; older verl versions omitted the sequence mean).

Global normaliser (micro-batching and data parallelism)
-------------------------------------------------------
Every mode is a sum of per-token or per-sequence terms divided by one count N. Left alone,
`agg_loss` divides by the count of the micro-batch it sees, so cutting an optimizer step into
micro-batches (or DP ranks) changes the result. To make it invariant the caller passes
`global_normalizer` = N of the *whole optimizer step*: the sum, over every micro-batch of every
DP rank, of `agg_loss_normalizer(loss_mask, mode)` (a token count for `token-mean`, a non-empty
sequence count for the `seq-mean-*` modes; all-reduce it over the DP group). Then

    sum over micro-batches and ranks of agg_loss(..., global_normalizer=N) == agg_loss(full step)

exactly (up to float rounding). What the worker still owns: with `calculate_per_token_loss=False`
megatron-core's pipeline schedule divides each micro-batch loss by the number of micro-batches and
Megatron DDP averages gradients over the DP(-CP) group; both must be undone (scale the loss by
`num_microbatches * dp_size`) so that the sum above is what gets differentiated.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is non-zero; 0 (not NaN) where nothing is valid.

    Args:
        values: any shape, e.g. `[B, T]`.
        mask: same shape as `values`; bool, int or float (1 = valid).
        dim: reduce over this dimension only; `None` reduces everything.

    The `1e-8` in the denominator is verl's, so metrics match it number for number.
    """
    # torch.where, not `values * mask`: a NaN/inf in a padded position must not leak as `0 * nan`.
    total = torch.where(mask.bool(), values, 0.0).sum(dim=dim)
    count = mask.to(values.dtype).sum(dim=dim)
    return total / (count + 1e-8)


def agg_loss_normalizer(loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """The count N that `agg_loss` divides by for this (micro-)batch.

    Args:
        loss_mask: `[B, T]`, 1 for tokens that count.
        loss_agg_mode: one of `LOSS_AGG_MODES`.

    Returns:
        scalar tensor: the number of valid tokens for `token-mean`, the number of sequences with
        at least one valid token for the `seq-mean-*` modes. Sum it over all micro-batches and DP
        ranks of an optimizer step to get the `global_normalizer` for `agg_loss`.
    """
    _check_mode(loss_agg_mode)
    if loss_agg_mode == "token-mean":
        return loss_mask.sum()
    return (loss_mask.sum(dim=-1) > 0).sum()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_normalizer: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar (see the module docstring for the formulas).

    Args:
        loss_mat: `[B, T]` per-token losses.
        loss_mask: `[B, T]`, 1 for tokens that count (bool, int or float).
        loss_agg_mode: one of `LOSS_AGG_MODES`.
        global_normalizer: N for the whole optimizer step (`agg_loss_normalizer` summed over all
            micro-batches and DP ranks). `None` uses this batch's own count, i.e. the plain
            full-batch value.
        loss_scale_factor: only for `seq-mean-token-sum-norm`: the constant length each
            sequence's token sum is divided by. `None` uses `T` (verl's default); set it to the
            max response length so it stays constant across steps and micro-batches padded to
            different lengths, as Dr. GRPO intends.

    Returns:
        scalar tensor (differentiable w.r.t. `loss_mat`).
    """
    _check_mode(loss_agg_mode)
    if loss_scale_factor is not None and loss_agg_mode != "seq-mean-token-sum-norm":
        raise ValueError(
            f"loss_scale_factor={loss_scale_factor} only applies to loss_agg_mode='seq-mean-token-sum-norm', "
            f"not {loss_agg_mode!r}; drop it or switch the mode"
        )
    if isinstance(global_normalizer, (int, float)) and global_normalizer <= 0:
        raise ValueError(f"global_normalizer must be > 0 (a token or sequence count), got {global_normalizer}")

    mask = loss_mask.to(loss_mat.dtype)
    # torch.where, not `loss_mat * mask`: a NaN/inf in a padded position must not leak as `0 * nan`.
    token_losses = torch.where(mask.bool(), loss_mat, 0.0)
    if loss_agg_mode == "token-mean":
        numerator = token_losses.sum()
    else:
        seq_losses = token_losses.sum(dim=-1)  # [B]
        if loss_agg_mode == "seq-mean-token-mean":
            # Empty sequences have a zero sum; clamping their length avoids 0/0.
            seq_losses = seq_losses / mask.sum(dim=-1).clamp(min=1)
        elif loss_agg_mode == "seq-mean-token-sum-norm":
            seq_losses = seq_losses / (loss_scale_factor if loss_scale_factor is not None else loss_mat.shape[-1])
        numerator = seq_losses.sum()

    if global_normalizer is None:
        # A micro-batch with nothing valid contributes 0, not NaN.
        global_normalizer = agg_loss_normalizer(loss_mask, loss_agg_mode).clamp(min=1)
    return numerator / global_normalizer


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
