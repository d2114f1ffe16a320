"""Policy-gradient losses: log-probs and advantages `[B, T]` -> a scalar loss and clip metrics.

Each entry of `POLICY_LOSSES` turns the inputs into a per-token loss matrix plus the tokens it
clipped; `compute_policy_loss` adds what all of them share: the off-policy correction's token weights
(`megarl.algorithms.rollout_correction`), the aggregation, and the metrics. Names and numbers follow
verl's `core_algos` (`vanilla`, `gspo`, `cispo`, `reinforce`) and slime's `ppo_utils`.

Ratios are taken in log space and the token log-ratio is clamped to [-20, 20] before `exp`
(verl's guard against overflow on badly off-policy tokens); GSPO clamps its sequence
log-ratio at 10 from above, as verl does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megarl.algorithms.losses import agg_loss, masked_mean

_LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class PolicyLossOutput:
    """Result of `compute_policy_loss`. Metrics are means over this batch's valid tokens, detached."""

    loss: torch.Tensor
    """Scalar loss to minimise (differentiable w.r.t. `log_prob`)."""
    clip_frac: torch.Tensor
    """Fraction of tokens where the clipped objective was taken (PPO/GSPO) or the ratio was
    truncated (CISPO); 0 for `reinforce`."""
    clip_frac_lower: torch.Tensor
    """Fraction of tokens with negative advantage whose loss the dual clip capped at
    `-A * clip_ratio_c` (`vanilla` only; 0 otherwise)."""
    approx_kl: torch.Tensor
    """k1 estimate of KL(old || current): mean of `old_log_prob - log_prob`."""


class TokenLosses(NamedTuple):
    """What a policy loss function returns before aggregation."""

    losses: torch.Tensor
    """`[B, T]` per-token loss."""
    clipped: torch.Tensor
    """`[B, T]` bool, tokens counted in `clip_frac`."""
    clipped_lower: torch.Tensor
    """`[B, T]` bool, tokens counted in `clip_frac_lower`."""


def compute_policy_loss(
    name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    importance_weights: torch.Tensor | None = None,
    global_normalizer: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> PolicyLossOutput:
    """Policy loss `name` for one (micro-)batch.

    Args:
        name: a key of `POLICY_LOSSES`.
        old_log_prob: `[B, T]` log-probs of the sampled tokens under the policy that generated
            the batch, recomputed by the trainer (no gradient).
        log_prob: `[B, T]` log-probs under the current policy (the gradient flows through these).
        advantages: `[B, T]`.
        response_mask: `[B, T]`, 1 on response tokens that count.
        clip_ratio_low: ratio clipped below at `1 - clip_ratio_low`.
        clip_ratio_high: ratio clipped above at `1 + clip_ratio_high` (DAPO's clip-higher: > low).
        clip_ratio_c: dual-clip bound for negative advantages (`vanilla`), must be > 1.
        loss_agg_mode: see `megarl.algorithms.losses`.
        importance_weights: `[B, T]` factors on the token losses, applied without gradient: the
            correction for the engines' sampling distribution
            (`megarl.algorithms.rollout_correction.correction_weights`). None: no correction.
        global_normalizer: token/sequence count of the whole optimizer step, see `agg_loss`.
        loss_scale_factor: constant length for `seq-mean-token-sum-norm`, see `agg_loss`.

    Returns:
        `PolicyLossOutput`.
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid policy losses: {', '.join(POLICY_LOSSES)}")
    if importance_weights is not None and importance_weights.shape != log_prob.shape:
        raise ValueError(
            f"importance_weights has shape {tuple(importance_weights.shape)}, the log-probs "
            f"{tuple(log_prob.shape)}: give one weight per token"
        )
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low={clip_ratio_low} and clip_ratio_high={clip_ratio_high} must be >= 0 "
            "(the ratio is clipped to [1 - low, 1 + high])"
        )

    mask = response_mask.to(log_prob.dtype)
    token = POLICY_LOSSES[name](
        old_log_prob,
        log_prob,
        advantages,
        mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    losses = token.losses
    if importance_weights is not None:
        losses = losses * importance_weights.detach()

    loss = agg_loss(
        losses, mask, loss_agg_mode, global_normalizer=global_normalizer, loss_scale_factor=loss_scale_factor
    )
    return PolicyLossOutput(
        loss=loss,
        clip_frac=masked_mean(token.clipped.to(mask.dtype), mask),
        clip_frac_lower=masked_mean(token.clipped_lower.to(mask.dtype), mask),
        approx_kl=masked_mean(old_log_prob - log_prob, mask).detach(),
    )


def vanilla(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """PPO clip (Schulman et al. 2017) with asymmetric bounds (DAPO) and dual clip (Ye et al. 2020).

    loss = max(-A r, -A clip(r, 1 - low, 1 + high)); for A < 0 additionally capped at -A c, so a
    huge ratio on a bad token cannot blow the loss up.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c is the dual-clip bound and must be > 1.0, got {clip_ratio_c}")
    ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    ppo_losses = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(ppo_losses, dual_bound), ppo_losses)
    return TokenLosses(losses, clipped > unclipped, (ppo_losses > dual_bound) & (advantages < 0))


def gspo(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low, clip_ratio_high, **_):
    """GSPO (Zheng et al. 2025), token form: ratio s_i = exp(mean_t log(pi / pi_old)) per sequence.

    Each token carries `sg[s_i] * pi_t / sg[pi_t]`: its value is the sequence ratio, its gradient
    `s_i * grad log pi_t`, so with sequence-constant advantages the gradient is exactly that of
    the sequence-level objective. The paper aggregates with `seq-mean-token-mean` (verl forces
    it for GSPO); here the caller's `loss_agg_mode` is used as given.
    """
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = torch.where(response_mask.bool(), log_prob - old_log_prob, 0.0).sum(dim=-1) / lengths
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = log_ratio.clamp(max=10.0).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    return TokenLosses(torch.maximum(unclipped, clipped), clipped > unclipped, torch.zeros_like(response_mask).bool())


def cispo(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low, clip_ratio_high, **_):
    """CISPO (MiniMax-M1, 2025): loss = -sg(clip(r, 1 - low, 1 + high)) * A * log pi.

    The ratio only weights the REINFORCE term, so clipped tokens still get a gradient.
    """
    ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT).exp()
    truncated = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = -truncated.detach() * advantages * log_prob
    return TokenLosses(losses, truncated != ratio, torch.zeros_like(response_mask).bool())


def reinforce(old_log_prob, log_prob, advantages, response_mask, **_):
    """REINFORCE: loss = -A * log pi, no ratio and no clipping (on-policy updates)."""
    no_clip = torch.zeros_like(response_mask).bool()
    return TokenLosses(-advantages * log_prob, no_clip, no_clip)


POLICY_LOSSES: dict[str, Callable[..., TokenLosses]] = {
    "vanilla": vanilla,
    "gspo": gspo,
    "cispo": cispo,
    "reinforce": reinforce,
}
"""Policy loss name -> function(old_log_prob, log_prob, advantages, response_mask, **clip) -> TokenLosses."""
