"""KL regularisation towards the reference policy: estimators, the reward penalty, the loss term, and
the coefficient controllers.

KL can enter training in two places (as in verl): subtracted from the token rewards before the
advantages (`apply_kl_penalty`, coefficient from a `FixedKLController` / `AdaptiveKLController`),
or added to the actor loss (`compute_kl_loss`, as GRPO does). Estimators are Schulman's
(http://joschu.net/blog/kl-approx.html), with verl's names, aliases and clamps.
"""

from __future__ import annotations

import math

import torch

from megarl.algorithms.losses import agg_loss, masked_mean


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # r = pi_ref / pi; r - log r - 1 >= 0, unbiased, low variance. The clamps are verl's: exp of a
    # log-ratio past 20 overflows float16/bfloat16 and a single token would dominate the batch.
    log_ref_ratio = (-log_ratio).clamp(-20.0, 20.0)
    return (log_ref_ratio.exp() - log_ref_ratio - 1).clamp(-10.0, 10.0)


KL_ESTIMATORS = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}
"""KL estimator name -> function(log_prob - ref_log_prob) -> per-token estimate. `kl`, `mse` and
`low_var_kl` are verl's names for k1, k2 and k3."""


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.

    Args:
        log_prob: `[B, T]` log-probs under the policy.
        ref_log_prob: `[B, T]` log-probs under the reference policy.
        kind: `k1` (log-ratio), `abs`, `k2` (half squared log-ratio, "mse") or `k3`
            ("low_var_kl", clamped to [-10, 10]).

    Returns:
        `[B, T]` estimate (padding positions are not masked here).
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid estimators: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](log_prob - ref_log_prob)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward: r_t = score_t - kl_coef * KL_t on response tokens.

    Args:
        token_level_scores: `[B, T]` rewards from the reward function/model.
        log_prob: `[B, T]` rollout policy log-probs (the trainer's `old_log_prob`).
        ref_log_prob: `[B, T]` reference log-probs.
        response_mask: `[B, T]`.
        kl_coef: the controller's current `value`.
        kind: KL estimator, see `kl_penalty`.

    Returns:
        (token_level_rewards `[B, T]`, current_kl scalar): current_kl is the per-sequence token
        mean of KL averaged over the batch (verl's `actor/reward_kl_penalty`); pass it to the
        controller's `update(current_kl, n_steps=B)`.
    """
    mask = response_mask.to(token_level_scores.dtype)
    # torch.where, not `* mask`: a NaN log-prob in padding must not reach the rewards (their
    # row sums are the outcome scores).
    kl = torch.where(mask.bool(), kl_penalty(log_prob, ref_log_prob, kind), 0.0)
    token_level_rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, mask, dim=-1).mean()
    return token_level_rewards, current_kl


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str,
    loss_agg_mode: str,
    *,
    global_normalizer: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> torch.Tensor:
    """KL as a loss term: `agg_loss(KL_t)`; the actor adds `kl_loss_coef * this` to its loss.

    Args:
        log_prob: `[B, T]` current policy log-probs (differentiable).
        ref_log_prob: `[B, T]` reference log-probs.
        response_mask: `[B, T]`.
        kind: KL estimator, see `kl_penalty` (GRPO uses `low_var_kl`).
        loss_agg_mode, global_normalizer, loss_scale_factor: see `agg_loss`.

    Returns:
        scalar tensor.
    """
    return agg_loss(
        kl_penalty(log_prob, ref_log_prob, kind),
        response_mask,
        loss_agg_mode,
        global_normalizer=global_normalizer,
        loss_scale_factor=loss_scale_factor,
    )


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Proportional controller of the KL coefficient (Ziegler et al. 2019, as in verl/TRL).

    After each batch: error = clip(current_kl / target_kl - 1, -0.2, 0.2) and
    value *= 1 + error * n_steps / horizon, so the coefficient grows while KL is above target and
    shrinks while below, by at most 20% per `horizon` samples.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"the adaptive KL controller needs target_kl > 0 and horizon > 0, "
                f"got target_kl={target_kl}, horizon={horizon}"
            )
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt `value` after a batch of `n_steps` samples whose mean KL was `current_kl`."""
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon
