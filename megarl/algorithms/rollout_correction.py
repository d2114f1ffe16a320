"""Off-policy corrections between the engines that sampled a batch and the actor that trains on it,
and the metrics of their mismatch.

Three policies, with AReaL's names (Fu et al. 2025, "AReaL: a large-scale asynchronous RL system"):
the **behaviour** policy π_behav, the rollout engines that sampled the tokens (their log-probs:
`rollout_log_prob`); the **proximal** policy π_prox, the actor's weights when the update starts
(the old-log-prob pass: `old_log_prob`); the current policy π_θ. The policy losses clip π_θ / π_prox;
π_behav differs from π_prox by precision (bf16 engines beside an fp32 actor), by kernels, and by
staleness (the engines of an off-policy mode hold older weights). A correction multiplies each
token's loss by a weight built from ρ = π_prox / π_behav, without gradient:

| level       | ρ of token t of sequence i                              |
|-------------|---------------------------------------------------------|
| `token`     | exp(δ_it)                                               |
| `sequence`  | exp(Σ_t δ_it): the product of the token ratios          |
| `geometric` | exp(mean_t δ_it): their geometric mean                  |

with δ = old_log_prob - rollout_log_prob over the response mask (clamped to [-20, 20] in log space
before `exp`, verl's guard; the sequence sum is clamped after summing).

| mode       | weight                                                                 |
|------------|------------------------------------------------------------------------|
| `truncate` | min(ρ, high): truncated IS (TIS, Yao et al. 2025)                      |
| `mask`     | ρ where low <= ρ <= high, else 0: masked IS (MIS; IcePop, Ring-1T 2025) |

A masked token keeps its place in the loss normaliser (IcePop's and AReaL's form): it is removed from
the gradient, not from the count the loss is divided by.

AReaL's **decoupled PPO** objective (its `ppo_actor_loss_fn` with `use_decoupled_loss`) is the
`vanilla` policy loss clipped against the proximal policy, times the behaviour weight π_prox / π_behav,
with tokens whose weight exceeds `behav_imp_weight_cap` filtered out: `vanilla` with a token-level
correction `mode: mask, low: 0, high: cap` (`mode: truncate` caps those tokens instead). It equals
plain PPO when the behaviour and proximal log-probs agree (every weight is 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

LEVELS = ("token", "sequence", "geometric")
"""How token log-ratios become the ratio a token's weight is made from (module docstring)."""
MODES = ("truncate", "mask")
"""What happens to a ratio outside the range: capped at `high`, or its token's loss masked."""
MISMATCH_METRICS = ("kl_k3", "kl_k1", "chi2_token", "chi2_seq", "ppl_ratio")
"""Keys of `mismatch_metrics`."""
_LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """One correction (module docstring): the ratio's level, what happens out of range, the range."""

    level: str = "token"
    """One of `LEVELS`."""
    mode: str = "truncate"
    """One of `MODES`."""
    low: float = 0.0
    """`mask` only: ratios below it are masked (0: no lower bound). In [0, 1]."""
    high: float = 2.0
    """`truncate`: the cap; `mask`: ratios above it are masked. >= 1."""

    def __post_init__(self) -> None:
        problems = []
        if self.level not in LEVELS:
            problems.append(f"level={self.level!r} is not one of {LEVELS}")
        if self.mode not in MODES:
            problems.append(f"mode={self.mode!r} is not one of {MODES}")
        if self.high < 1:
            problems.append(f"high={self.high} must be >= 1 (an on-policy token has ratio 1 and keeps weight 1)")
        if not 0 <= self.low <= 1:
            problems.append(f"low={self.low} must lie in [0, 1] (an on-policy token has ratio 1 and is kept)")
        if self.mode == "truncate" and self.low != 0:
            problems.append(
                f"low={self.low} with mode='truncate': truncation caps from above only; "
                "use mode='mask' to drop low ratios"
            )
        if problems:
            raise ValueError("RolloutCorrection: " + "; ".join(problems))


class CorrectionWeights(NamedTuple):
    """What `correction_weights` returns."""

    weights: Tensor
    """`[B, T]` float, no gradient: the factor on each token's loss (0 on padding)."""
    out_of_range: Tensor
    """`[B, T]` bool: response tokens whose ratio left the range (masked, or capped at `high`)."""


def correction_weights(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, correction: RolloutCorrection
) -> CorrectionWeights:
    """The correction's token weights for one (micro-)batch of whole sequences.

    Args:
        old_log_prob: `[B, T]` proximal log-probs (the actor's, when the update starts).
        rollout_log_prob: `[B, T]` behaviour log-probs (the engines', while sampling).
        response_mask: `[B, T]` 1 on the response tokens that count.
        correction: level, mode and range.
    """
    mask = response_mask.bool()
    token_log_ratio = torch.where(mask, old_log_prob - rollout_log_prob, 0.0).detach()
    if correction.level == "token":
        log_ratio = token_log_ratio
    else:
        log_ratio = token_log_ratio.sum(dim=-1, keepdim=True)
        if correction.level == "geometric":
            log_ratio = log_ratio / mask.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.expand_as(token_log_ratio)
    ratio = log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT).exp()
    if correction.mode == "truncate":
        out_of_range = ratio > correction.high
        weights = ratio.clamp(max=correction.high)
    else:
        out_of_range = (ratio < correction.low) | (ratio > correction.high)
        weights = torch.where(out_of_range, 0.0, ratio)
    return CorrectionWeights(torch.where(mask, weights, 0.0), out_of_range & mask)


def correction_metrics(
    result: CorrectionWeights,
    response_mask: Tensor,
    *,
    tokens: Tensor | float | None = None,
    sequences: Tensor | float | None = None,
) -> dict[str, Tensor]:
    """`weight_mean` (token mean of the weights), `out_of_range_tokens` (fraction of response tokens
    whose ratio left the range) and `out_of_range_seqs` (fraction of sequences with at least one such
    token; at the sequence levels every token of a sequence shares its ratio).

    `tokens` / `sequences`: what the token / sequence sums are divided by; None: this batch's own
    response tokens / non-empty sequences. Pass an optimizer step's counts to get shares that add up
    over its micro-batches and ranks."""
    mask = response_mask.bool()
    tokens = mask.sum() if tokens is None else tokens
    sequences = _non_empty(mask).sum() if sequences is None else sequences
    return dict(
        weight_mean=result.weights.sum() / tokens,
        out_of_range_tokens=result.out_of_range.sum() / tokens,
        out_of_range_seqs=(result.out_of_range.any(dim=-1) & _non_empty(mask)).sum() / sequences,
    )


def mismatch_metrics(
    actor_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    tokens: Tensor | float | None = None,
    sequences: Tensor | float | None = None,
) -> dict[str, Tensor]:
    """How far the engines' sampling distribution is from the actor's, on the sampled response tokens
    (no gradient). With ρ = π_actor / π_rollout per token (log-ratio clamped to [-20, 20]):

    - `kl_k3`: token mean of ρ - 1 - log ρ, Schulman's k3 estimator of KL(π_rollout ‖ π_actor): the
      tokens were sampled from π_rollout, under which E[ρ] = 1, so it is unbiased; >= 0 per token.
    - `kl_k1`: token mean of -log ρ = log π_rollout - log π_actor, the direct estimator of the same KL
      (unbiased, higher variance, may be negative).
    - `chi2_token`: token mean of ρ² - 1, χ²(π_actor ‖ π_rollout) per token (the variance of the token
      weights; verl's `chi2_token`); an estimate, which a batch may put slightly below 0.
    - `chi2_seq`: sequence mean of (Π_t ρ_t)² - 1, the same for whole sequences (sum clamped at 20).
    - `ppl_ratio`: sequence mean of rollout perplexity / actor perplexity = exp(mean_t log ρ); > 1: the
      engines found their own samples less likely than the actor does.

    `tokens` / `sequences`: the denominators of token / sequence means, as in `correction_metrics`.
    """
    mask = response_mask.bool()
    non_empty = _non_empty(mask)
    tokens = mask.sum() if tokens is None else tokens
    sequences = non_empty.sum() if sequences is None else sequences
    log_ratio = torch.where(mask, actor_log_prob - rollout_log_prob, 0.0).detach()
    token_log_ratio = log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = token_log_ratio.exp()
    seq_log_ratio = log_ratio.sum(dim=-1)
    mean_log_ratio = seq_log_ratio / mask.sum(dim=-1).clamp(min=1)

    def token_mean(per_token: Tensor) -> Tensor:
        return torch.where(mask, per_token, 0.0).sum() / tokens

    def sequence_mean(per_sequence: Tensor) -> Tensor:
        return torch.where(non_empty, per_sequence, 0.0).sum() / sequences

    return dict(
        kl_k3=token_mean(ratio - 1 - token_log_ratio),
        kl_k1=token_mean(-log_ratio),
        chi2_token=token_mean(ratio.square() - 1),
        chi2_seq=sequence_mean((2 * seq_log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)).exp() - 1),
        ppl_ratio=sequence_mean(mean_log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT).exp()),
    )


def _non_empty(mask: Tensor) -> Tensor:
    """`[B]` bool: sequences with at least one response token that counts."""
    return mask.any(dim=-1)
