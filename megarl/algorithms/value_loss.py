"""Critic loss (clipped value regression) and the policy entropy term, as in verl's `core_algos`."""

from __future__ import annotations

import torch

from megarl.algorithms.losses import agg_loss, masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str,
    global_normalizer: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO value loss: 0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).

    Note the argument order: old `values` come before `returns` (verl's positional order is
    vpreds, returns, values); pass them by name when in doubt.

    Args:
        vpreds: `[B, T]` values predicted by the critic being trained (differentiable).
        values: `[B, T]` values of the same critic when the batch was collected.
        returns: `[B, T]` regression targets (from `compute_advantages`).
        response_mask: `[B, T]`.
        cliprange_value: how far a prediction may move from `values` before its loss is clipped.
        loss_agg_mode, global_normalizer, loss_scale_factor: see `agg_loss`.

    Returns:
        (loss scalar, clip_frac scalar): clip_frac is the fraction of valid tokens where the
        clipped term was the larger one (detached).
    """
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    loss = 0.5 * agg_loss(
        torch.maximum(unclipped, clipped),
        response_mask,
        loss_agg_mode,
        global_normalizer=global_normalizer,
        loss_scale_factor=loss_scale_factor,
    )
    clip_frac = masked_mean((clipped > unclipped).to(vpreds.dtype), response_mask).detach()
    return loss, clip_frac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """`[..., V]` logits -> `[...]` entropy of the softmax: logsumexp(z) - sum softmax(z) * z."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_normalizer: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> torch.Tensor:
    """Aggregated entropy of the policy over response tokens (positive; the actor subtracts
    `entropy_coeff * this` to encourage exploration).

    Args:
        logits: `[B, T, V]` (a vocab-parallel actor computes its entropy itself and can call
            `agg_loss` on the `[B, T]` result instead).
        response_mask: `[B, T]`.
        loss_agg_mode, global_normalizer, loss_scale_factor: see `agg_loss`.

    Returns:
        scalar tensor.
    """
    return agg_loss(
        entropy_from_logits(logits),
        response_mask,
        loss_agg_mode,
        global_normalizer=global_normalizer,
        loss_scale_factor=loss_scale_factor,
    )
