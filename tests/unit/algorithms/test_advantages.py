"""Advantage estimators: hand-computed values, group edge cases, loop-vs-vectorised equivalence."""

import math
import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages

# Seven samples in three groups, interleaved. Group "a" has scores 3, 1, 2; group "b" is a single
# sample (score 5); group "c" has three equal scores (2). Response lengths 3, 2, 1, 3, 3, 2, 3:
# sample 2 is a 1-token response in the middle of the batch. Each score sits on the last token.
INDEX = ["a", "b", "a", "c", "c", "a", "c"]
LENGTHS = [3, 2, 1, 3, 3, 2, 3]
SCORES = [3.0, 5.0, 1.0, 2.0, 2.0, 2.0, 2.0]
MASK = (torch.arange(3) < torch.tensor(LENGTHS).unsqueeze(-1)).float()
REWARDS = torch.zeros(7, 3)
REWARDS[torch.arange(7), torch.tensor(LENGTHS) - 1] = torch.tensor(SCORES)


def _broadcast(per_sample):
    return torch.tensor(per_sample).unsqueeze(-1) * MASK


def test_grpo_hand_values():
    # group a: mean 2, unbiased std sqrt((1 + 1 + 0) / 2) = 1 -> (3-2)/1, (1-2)/1, (2-2)/1.
    # group b has one sample -> 0; group c is all equal -> 0 / (0 + eps) = 0.
    advantages, returns = compute_advantages("grpo", REWARDS, MASK, index=INDEX)
    expected = _broadcast([1 / (1 + 1e-6), 0, -1 / (1 + 1e-6), 0, 0, 0, 0])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_dr_grpo_does_not_divide_by_std():
    # group a: 3-2, 1-2, 2-2; the rest 0.
    scores = REWARDS * 10  # a std of 10 would show up if it were divided by
    advantages, _ = compute_advantages("grpo", scores, MASK, index=INDEX, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(advantages, _broadcast([10.0, 0, -10.0, 0, 0, 0, 0]))


def test_rloo_hand_values():
    # A_i = r_i - mean of the others: 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0.
    advantages, _ = compute_advantages("rloo", REWARDS, MASK, index=INDEX)
    torch.testing.assert_close(advantages, _broadcast([1.5, 0, -1.5, 0, 0, 0, 0]))


def test_opo_hand_values():
    # group a: lengths 3, 1, 2 -> baseline (3*3 + 1*1 + 2*2) / 6 = 7/3 -> 2/3, -4/3, -1/3.
    # group c: baseline 2 -> 0; group b: single sample -> 0.
    advantages, _ = compute_advantages("opo", REWARDS, MASK, index=INDEX)
    torch.testing.assert_close(advantages, _broadcast([2 / 3, 0, -4 / 3, 0, 0, -1 / 3, 0]))


def test_reinforce_plus_plus_baseline_hand_values():
    # Before whitening: 1 on sample 0's 3 tokens, -1 on sample 2's 1 token, 0 on the other 13 of
    # 17 valid tokens. Mean 2/17; unbiased var (4 - 17 * (2/17)^2) / 16 = 4/17, std 2/sqrt(17).
    # Whitened: (1 - 2/17) * sqrt(17)/2 = 15/(2 sqrt 17); (-1 - 2/17) * sqrt(17)/2 = -19/(2 sqrt 17);
    # zeros become -1/sqrt(17).
    advantages, _ = compute_advantages("reinforce_plus_plus_baseline", REWARDS, MASK, index=INDEX)
    root = math.sqrt(17)
    expected = torch.full((7,), -1 / root)
    expected[0], expected[2] = 15 / (2 * root), -19 / (2 * root)
    torch.testing.assert_close(advantages, expected.unsqueeze(-1) * MASK, rtol=1e-5, atol=1e-6)


def test_reinforce_plus_plus_hand_values():
    # gamma 0.5. Row 0: returns 0.25, 0.5, 1. Row 1 (length 2, garbage reward 7 in its padding):
    # t=2 holds 7 but the running return restarts after the masked position, so t=1: 2, t=0: 1.
    # Valid returns 0.25, 0.5, 1, 1, 2: mean 0.95, squared deviations sum 1.8, unbiased var 0.45.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns * mask, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    expected = (torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.95]]) - 0.95) / math.sqrt(0.45)
    torch.testing.assert_close(advantages, expected * mask)


def test_remax_hand_values():
    # Reward-to-go row 0: 1, 1, 1; row 1 (length 2): 2, 2. Baselines 0.5 and 3.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = compute_advantages("remax", rewards, mask, reward_baselines=torch.tensor([0.5, 3.0]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]]))


def test_gae_hand_values_with_masked_token_inside_response():
    # gamma 1, lam 0.5.
    # Row 0: V = .5 .6 .8, reward 1 at the end. deltas: t2 1 - .8 = .2; t1 .8 - .6 = .2; t0 .6 - .5 = .1
    #   A2 = .2, A1 = .2 + .5*.2 = .3, A0 = .1 + .5*.3 = .25; returns A + V = .75, .9, 1.
    # Row 1: token 1 is masked (e.g. a tool observation) with a bogus value 9 that must be skipped.
    #   t2: delta = 2 - 1.5 = .5, A2 = .5; t0: delta = 1.5 - 1 = .5, A0 = .5 + .5*.5 = .75;
    #   returns 1.75 and 2.
    # Whitening over the 5 valid A's (.25 .3 .2 .75 .5): mean .4, squared deviations .205, var .05125.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.6, 0.8], [1.0, 9.0, 1.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    advantages, returns = compute_advantages("gae", rewards, mask, values=values, gamma=1.0, lam=0.5)
    torch.testing.assert_close(returns * mask, torch.tensor([[0.75, 0.9, 1.0], [1.75, 0.0, 2.0]]))
    raw = torch.tensor([[0.25, 0.3, 0.2], [0.75, 0.4, 0.5]])
    torch.testing.assert_close(advantages, (raw - 0.4) / math.sqrt(0.05125) * mask)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline"])
def test_group_of_one_gets_zero_advantage(estimator):
    # Two singleton groups and one pair; the singletons must be exactly 0 (no division by zero).
    rewards = torch.tensor([[0.0, 4.0], [1.0, 0.0], [0.0, 3.0], [0.0, 0.0]])
    mask = torch.ones(4, 2)
    advantages, _ = compute_advantages(estimator, rewards, mask, index=[10, 11, 12, 12])
    # (for reinforce_plus_plus_baseline the batch mean before whitening is (1.5 - 1.5) / 8 = 0, so
    # whitening keeps the singletons at 0 too)
    assert torch.isfinite(advantages).all()
    assert torch.equal(advantages[:2], torch.zeros(2, 2))
    assert (advantages[2] > 0).all() and (advantages[3] < 0).all()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "opo"])
def test_all_equal_rewards_give_zero(estimator):
    rewards = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])  # every sample scores 1
    advantages, _ = compute_advantages(estimator, rewards, torch.ones(3, 2), index=["p"] * 3)
    assert torch.equal(advantages, torch.zeros(3, 2))


def test_index_may_be_numpy_uuids_or_ints():
    # Same partition under three id types -> same advantages.
    as_str = np.array(["u1", "u2", "u1", "u3", "u3", "u1", "u3"], dtype=object)
    as_int = np.array([7, 8, 7, 9, 9, 7, 9])
    reference, _ = compute_advantages("grpo", REWARDS, MASK, index=INDEX)
    for index in (as_str, as_int, tuple(INDEX)):
        torch.testing.assert_close(compute_advantages("grpo", REWARDS, MASK, index=index)[0], reference)


# --- loop references: plain per-sample Python, following verl's loop implementations ---------------


def _loop_group_scores(rewards, index):
    groups = defaultdict(list)
    for i in range(len(index)):
        groups[index[i]].append(float(rewards[i].sum()))
    return groups


def _loop_grpo(rewards, mask, index, norm_by_std, eps=1e-6):
    groups = _loop_group_scores(rewards, index)
    out = torch.zeros_like(rewards)
    for i in range(len(index)):
        scores = groups[index[i]]
        n = len(scores)
        if n == 1:
            continue
        mean = sum(scores) / n
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1))
        advantage = float(rewards[i].sum()) - mean
        if norm_by_std:
            advantage /= std + eps
        out[i] = advantage * mask[i]
    return out


def _loop_rloo(rewards, mask, index):
    groups = _loop_group_scores(rewards, index)
    out = torch.zeros_like(rewards)
    for i in range(len(index)):
        scores = groups[index[i]]
        n = len(scores)
        if n > 1:
            out[i] = (float(rewards[i].sum()) - (sum(scores) - float(rewards[i].sum())) / (n - 1)) * mask[i]
    return out


def _loop_gae(rewards, values, mask, gamma, lam):
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    for b in range(batch):
        next_value, next_advantage = 0.0, 0.0
        for t in reversed(range(length)):
            if mask[b, t]:
                delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
                next_advantage = delta + gamma * lam * next_advantage
                next_value = float(values[b, t])
            advantages[b, t] = next_advantage
    returns = advantages + values
    valid = advantages[mask.bool()]
    mean, var = valid.mean(), valid.var(unbiased=True)
    return (advantages - mean) / torch.sqrt(var + 1e-8) * mask, returns


def _random_groups(seed, num_groups=12, max_size=5, length=7):
    rng = random.Random(seed)
    index, lengths = [], []
    for g in range(num_groups):
        size = 1 if g == 0 else rng.randint(1, max_size)  # at least one singleton group
        index += [f"prompt-{g}"] * size
        lengths += [rng.randint(0, length) for _ in range(size)]  # includes empty responses
    order = list(range(len(index)))
    rng.shuffle(order)  # groups interleaved across the batch
    index = [index[i] for i in order]
    lengths = torch.tensor([lengths[i] for i in order])
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).double()
    # binary outcome rewards on the last token -> plenty of all-equal groups
    rewards = torch.zeros(len(index), length, dtype=torch.float64)
    last = (lengths - 1).clamp(min=0)
    rewards[torch.arange(len(index)), last] = torch.tensor([float(rng.random() < 0.5) for _ in index]).double()
    rewards = rewards * mask
    return rewards, mask, index


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(seed, norm_by_std):
    rewards, mask, index = _random_groups(seed)
    advantages, _ = compute_advantages("grpo", rewards, mask, index=index, norm_adv_by_std_in_grpo=norm_by_std)
    torch.testing.assert_close(advantages, _loop_grpo(rewards, mask, index, norm_by_std))


@pytest.mark.parametrize("seed", range(5))
def test_rloo_matches_loop(seed):
    rewards, mask, index = _random_groups(seed)
    advantages, _ = compute_advantages("rloo", rewards, mask, index=index)
    torch.testing.assert_close(advantages, _loop_rloo(rewards, mask, index))


@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    values = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=gen) < 0.7).double()  # holes anywhere, as in multi-turn
    advantages, returns = compute_advantages("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    loop_advantages, loop_returns = _loop_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, loop_advantages)
    torch.testing.assert_close(returns, loop_returns)


# --- errors ------------------------------------------------------------------------------------------


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as error:
        compute_advantages("ppo", REWARDS, MASK)
    for name in ADVANTAGE_ESTIMATORS:
        assert name in str(error.value)


@pytest.mark.parametrize(
    "estimator, missing",
    [("grpo", "index"), ("rloo", "index"), ("opo", "index"), ("gae", "values"), ("remax", "reward_baselines")],
)
def test_missing_input_is_named(estimator, missing):
    with pytest.raises(ValueError, match=f"{estimator}.*{missing}"):
        compute_advantages(estimator, REWARDS, MASK)


def test_index_length_must_match_batch():
    with pytest.raises(ValueError, match="index has 2 entries but the batch has 7"):
        compute_advantages("grpo", REWARDS, MASK, index=["a", "b"])


def test_advantages_carry_no_gradient():
    rewards = REWARDS.clone().requires_grad_(True)
    advantages, returns = compute_advantages("grpo", rewards, MASK, index=INDEX)
    assert not advantages.requires_grad and not returns.requires_grad


def test_index_may_be_a_tensor():
    # 0-d tensors hash by identity; a tensor index must still group by value.
    as_tensor = torch.tensor([0, 1, 0, 2, 2, 0, 2])
    reference, _ = compute_advantages("grpo", REWARDS, MASK, index=INDEX)
    torch.testing.assert_close(compute_advantages("grpo", REWARDS, MASK, index=as_tensor)[0], reference)
