"""Advantage estimators: token-level rewards `[B, T]` -> (advantages `[B, T]`, returns `[B, T]`).

Names and numbers follow verl's `core_algos` (same estimator names, same formulas, same epsilons),
with one deliberate difference: a group with a single sample gets advantage 0 for every
group-based estimator, because its baseline is its own reward (verl substitutes mean 0 / std 1 for
singletons and gives GRPO `r / (1 + eps)`, RLOO/OPO/RF++-baseline `r`). One sample has nothing to
be compared with, so it carries no learning signal.

Group-based estimators (`grpo`, `rloo`, `opo`, `reinforce_plus_plus_baseline`) take `index`: the
prompt/group id of each sample (any hashables: a list, a numpy array of uuids or ints). Samples
with equal ids form a group; order within the batch does not matter.

All estimators are outcome-reward estimators except `gae` and `reinforce_plus_plus`, which use
every token's reward (the sequence score usually sits on the last valid token).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from megarl.algorithms.losses import masked_mean


@torch.no_grad()
def compute_advantages(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Sequence[Hashable] | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute advantages and returns with the named estimator.

    Args:
        estimator: a key of `ADVANTAGE_ESTIMATORS`.
        token_level_rewards: `[B, T]` reward of each response token (KL penalty already applied).
        response_mask: `[B, T]`, 1 on response tokens, 0 on padding.
        index: `[B]` group id of each sample (`grpo`, `rloo`, `opo`, `reinforce_plus_plus_baseline`).
        values: `[B, T]` critic values of the rollout (`gae`).
        reward_baselines: `[B]` reward of the greedy response to the same prompt (`remax`).
        gamma: discount (`gae`, `reinforce_plus_plus`).
        lam: GAE lambda (`gae`).
        norm_adv_by_std_in_grpo: `grpo` divides by the group std; False is Dr. GRPO.
        epsilon: added to the group std before dividing (`grpo`).

    Returns:
        (advantages `[B, T]`, returns `[B, T]`), without gradient; advantages are 0 on padding.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; valid estimators: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T]"
        )
    return ADVANTAGE_ESTIMATORS[estimator](
        token_level_rewards,
        response_mask.to(token_level_rewards.dtype),
        index=index,
        values=values,
        reward_baselines=reward_baselines,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
    )


def group_ids(index: Sequence[Hashable] | torch.Tensor, batch_size: int) -> tuple[torch.Tensor, list[Hashable]]:
    """Dense group numbers for arbitrary hashable ids.

    Args:
        index: `[B]` ids (list, tuple, numpy array or 1-D tensor).
        batch_size: B, to check `index` against.

    Returns:
        (`[B]` int64 group number of each sample; the G distinct ids, position = group number, in
        order of first appearance).
    """
    if isinstance(index, torch.Tensor):
        index = index.tolist()  # 0-d tensors hash by identity: every sample would be its own group
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} entries but the batch has {batch_size} samples")
    numbers: dict[Hashable, int] = {}
    ids = [numbers.setdefault(key, len(numbers)) for key in index]
    return torch.tensor(ids, dtype=torch.long), list(numbers)


def group_stats(scores: torch.Tensor, index: Sequence[Hashable] | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample statistics of the sample's group.

    Args:
        scores: `[B]` one score per sample.
        index: `[B]` group ids.

    Returns:
        (count `[B]`, mean `[B]`, unbiased std `[B]`) of each sample's group; the std of a
        group of one is 0.
    """
    groups, keys = group_ids(index, len(scores))
    num_groups = len(keys)
    count = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, groups, torch.ones_like(scores))
    mean = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, groups, scores) / count
    # Two passes (mean first) instead of E[x^2] - E[x]^2: no cancellation for large rewards.
    squares = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, groups, (scores - mean[groups]) ** 2)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return count[groups], mean[groups], std[groups]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalise `values` to zero mean, unit variance over the valid tokens of the whole batch.

    Args:
        values: `[B, T]`.
        mask: `[B, T]`, 1 = valid.

    Same statistics as verl's `masked_whiten`: unbiased variance, `rsqrt(var + 1e-8)`.
    """
    num_valid = mask.sum()
    if num_valid < 2:
        raise ValueError(
            f"whitening advantages needs at least 2 valid response tokens in the batch, got {int(num_valid)}"
        )
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask) * num_valid / (num_valid - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def _require(value, name: str, estimator: str):
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs `{name}`, but it was not given")
    return value


def _outcome_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """`[B, T]` -> `[B]`: an outcome reward is the sum of the token rewards."""
    return token_level_rewards.sum(dim=-1)


def gae(token_level_rewards, response_mask, *, values, gamma, lam, **_):
    """Generalised Advantage Estimation (Schulman et al. 2016), advantages whitened over the batch.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}.
    Masked positions (padding, or tool/observation tokens inside a multi-turn response) are
    skipped: the recursion carries V and A across them unchanged (a masked position holds the
    carried A, as in verl). Returns = A (before whitening) + V.
    """
    values = _require(values, "values", "gae")
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        valid = response_mask[:, t].bool()
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(valid, delta + gamma * lam * next_advantage, next_advantage)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = next_advantage
    returns = advantages + values
    return masked_whiten(advantages, response_mask) * response_mask, returns


def grpo(token_level_rewards, response_mask, *, index, norm_adv_by_std_in_grpo, epsilon, **_):
    """GRPO (Shao et al. 2024): A_i = (r_i - mean_g) / (std_g + eps), std unbiased.

    With `norm_adv_by_std_in_grpo=False`: A_i = r_i - mean_g (Dr. GRPO, Liu et al. 2025).
    A group whose rewards are all equal, a group of one included, gets 0 (0 / eps).
    """
    scores = _outcome_scores(token_level_rewards)
    _count, mean, std = group_stats(scores, _require(index, "index", "grpo"))
    advantage = scores - mean
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std + epsilon)
    advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


def rloo(token_level_rewards, response_mask, *, index, **_):
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other n-1 rewards = n/(n-1) (r_i - mean_g)."""
    scores = _outcome_scores(token_level_rewards)
    count, mean, _std = group_stats(scores, _require(index, "index", "rloo"))
    advantage = (scores - mean) * count / (count - 1).clamp(min=1)
    advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


def opo(token_level_rewards, response_mask, *, index, **_):
    """OPO (Hao et al. 2025): baseline = length-weighted group mean sum_j |y_j| r_j / sum_j |y_j|."""
    scores = _outcome_scores(token_level_rewards)
    groups, keys = group_ids(_require(index, "index", "opo"), len(scores))
    num_groups = len(keys)
    lengths = response_mask.sum(dim=-1)
    weighted = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, groups, lengths * scores)
    total_length = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, groups, lengths)
    # A group of empty responses has no length to weight by; its advantages are masked to 0 anyway.
    baseline = weighted / total_length.clamp(min=1)
    advantages = (scores - baseline[groups]).unsqueeze(-1) * response_mask
    return advantages, advantages


def reinforce_plus_plus_baseline(token_level_rewards, response_mask, *, index, **_):
    """REINFORCE++ with group baseline (Hu et al. 2025): A_i = r_i - mean_g, broadcast to the
    tokens, then whitened over all valid tokens of the batch."""
    scores = _outcome_scores(token_level_rewards)
    _count, mean, _std = group_stats(scores, _require(index, "index", "reinforce_plus_plus_baseline"))
    advantages = masked_whiten((scores - mean).unsqueeze(-1) * response_mask, response_mask) * response_mask
    return advantages, advantages


def reinforce_plus_plus(token_level_rewards, response_mask, *, gamma, **_):
    """REINFORCE++ (Hu et al. 2025): discounted return G_t = r_t + gamma * G_{t+1}, whitened over the
    batch. The running return restarts after every masked position (as verl does), so nothing
    flows back from padding."""
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    return masked_whiten(returns, response_mask) * response_mask, returns


def remax(token_level_rewards, response_mask, *, reward_baselines, **_):
    """ReMax (Li et al. 2023): A_t = G_t - b, with G_t the undiscounted reward-to-go and b the
    reward of the greedy response to the same prompt."""
    reward_baselines = _require(reward_baselines, "reward_baselines", "remax")
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * response_mask
    return advantages, returns


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": gae,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_plus_plus": reinforce_plus_plus,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
    "remax": remax,
    "opo": opo,
}
"""Advantage estimator name -> function(token_level_rewards, response_mask, **inputs)."""
