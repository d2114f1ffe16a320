"""Off-policy corrections and mismatch metrics, by hand: truncation and masking at every level, the
sequence weight as the product of token ratios, identity when the engines agree with the actor,
AReaL's decoupled PPO (and plain PPO as its limit), metrics that add up over micro-batches."""

import math

import pytest
import torch

from megarl.algorithms.policy_loss import compute_policy_loss
from megarl.algorithms.rollout_correction import (
    LEVELS,
    MODES,
    RolloutCorrection,
    correction_metrics,
    correction_weights,
    mismatch_metrics,
)

DTYPE = torch.float64


def _rollout_for(old_log_prob, ratios):
    """Rollout log-probs giving the ratios π_old / π_rollout."""
    return old_log_prob - torch.tensor(ratios, dtype=DTYPE).log()


def test_token_truncation_caps_high_ratios_only():
    old = torch.tensor([[-1.0, -2.0, -1.0, -3.0]], dtype=DTYPE)
    rollout = _rollout_for(old, [[3.0, 0.5, 1.0, 1e6]])
    mask = torch.tensor([[1, 1, 1, 0]])  # the padded token's huge ratio must not count
    result = correction_weights(old, rollout, mask, RolloutCorrection("token", "truncate", high=2.0))
    torch.testing.assert_close(result.weights, torch.tensor([[2.0, 0.5, 1.0, 0.0]], dtype=DTYPE))
    assert result.out_of_range.tolist() == [[True, False, False, False]]


def test_token_masking_removes_exactly_the_tokens_outside_the_range():
    old = torch.full((1, 6), -1.0, dtype=DTYPE)
    ratios = [[0.4, 0.5, 1.0, 2.0, 2.1, 0.7]]
    rollout = _rollout_for(old, ratios)
    mask = torch.ones(1, 6)
    result = correction_weights(old, rollout, mask, RolloutCorrection("token", "mask", low=0.5, high=2.0))
    # IcePop's weight: ρ inside [low, high] (bounds included), 0 outside.
    torch.testing.assert_close(result.weights, torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.0, 0.7]], dtype=DTYPE))
    assert result.out_of_range.tolist() == [[True, False, False, False, True, False]]


def _random_log_probs(seed, rows=4, length=6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=gen, dtype=DTYPE) * 3
    rollout = old + (torch.rand(rows, length, generator=gen, dtype=DTYPE) - 0.5)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0], [0] * 6])  # a hole, an empty row
    return old, rollout, mask


def test_sequence_weight_is_the_product_of_token_ratios_and_geometric_its_geometric_mean():
    old, rollout, mask = _random_log_probs(0)
    wide = dict(mode="truncate", high=1e6)  # nothing capped
    sequence = correction_weights(old, rollout, mask, RolloutCorrection("sequence", **wide)).weights
    geometric = correction_weights(old, rollout, mask, RolloutCorrection("geometric", **wide)).weights
    for row in range(3):
        ratios = [math.exp(old[row, t] - rollout[row, t]) for t in range(6) if mask[row, t]]
        product = math.prod(ratios)
        for t in range(6):
            expected = (product, product ** (1 / len(ratios))) if mask[row, t] else (0.0, 0.0)
            assert (sequence[row, t].item(), geometric[row, t].item()) == pytest.approx(expected, rel=1e-12)
    assert not sequence[3].any() and not geometric[3].any()


def test_sequence_masking_masks_whole_sequences():
    old = torch.full((3, 2), -1.0, dtype=DTYPE)
    # products 2 * 2 = 4 (out), 3 * 0.5 = 1.5 (in, though one token alone is 3), 0.5 * 0.5 = 0.25 (out)
    rollout = _rollout_for(old, [[2.0, 2.0], [3.0, 0.5], [0.5, 0.5]])
    result = correction_weights(old, rollout, torch.ones(3, 2), RolloutCorrection("sequence", "mask", 0.5, 2.0))
    torch.testing.assert_close(result.weights, torch.tensor([[0.0, 0.0], [1.5, 1.5], [0.0, 0.0]], dtype=DTYPE))
    metrics = correction_metrics(result, torch.ones(3, 2))
    assert metrics["out_of_range_seqs"].item() == pytest.approx(2 / 3)
    assert metrics["out_of_range_tokens"].item() == pytest.approx(4 / 6)
    assert metrics["weight_mean"].item() == pytest.approx(3.0 / 6)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
def test_every_correction_is_the_identity_when_the_engines_agree_with_the_actor(level, mode):
    old, _, mask = _random_log_probs(1)
    correction = RolloutCorrection(level, mode, low=0.5 if mode == "mask" else 0.0, high=1.5)
    result = correction_weights(old, old.clone(), mask, correction)
    torch.testing.assert_close(result.weights, mask.to(DTYPE))
    assert not result.out_of_range.any()
    current = (old + 0.1).requires_grad_(True)
    advantages = torch.linspace(-1, 1, 24, dtype=DTYPE).reshape(4, 6)
    corrected = compute_policy_loss("vanilla", old, current, advantages, mask, importance_weights=result.weights)
    plain = compute_policy_loss("vanilla", old, current, advantages, mask)
    assert corrected.loss.item() == plain.loss.item()


def test_decoupled_ppo_matches_areal_by_hand_and_plain_ppo_when_behaviour_is_proximal():
    # AReaL's decoupled objective, token by token: w * max(-A r, -A clip(r, 0.8, 1.2)), r = π_θ / π_prox,
    # w = π_prox / π_behav, tokens with w above the cap (5) filtered out, divided by all 4 tokens.
    #   token  w    r    A   -A r   -A clip(r)  max    w * max
    #   0      1.5  1.1  +1  -1.1   -1.1        -1.1   -1.65
    #   1      0.5  0.7  -1   0.7    0.8         0.8    0.4
    #   2      6    1.0  +1  -1.0   -1.0        -1.0    0 (w > 5: filtered)
    #   3      1    1.3  +1  -1.3   -1.2        -1.2   -1.2
    proximal = torch.full((1, 4), -1.0, dtype=DTYPE)
    behaviour = _rollout_for(proximal, [[1.5, 0.5, 6.0, 1.0]])
    current = proximal + torch.tensor([[1.1, 0.7, 1.0, 1.3]], dtype=DTYPE).log()
    advantages = torch.tensor([[1.0, -1.0, 1.0, 1.0]], dtype=DTYPE)
    mask = torch.ones(1, 4)
    areal = RolloutCorrection("token", "mask", low=0.0, high=5.0)  # behav_imp_weight_cap: 5
    weights = correction_weights(proximal, behaviour, mask, areal).weights
    decoupled = compute_policy_loss("vanilla", proximal, current, advantages, mask, importance_weights=weights)
    assert decoupled.loss.item() == pytest.approx((-1.65 + 0.4 + 0 - 1.2) / 4)

    same = correction_weights(proximal, proximal.clone(), mask, areal).weights
    decoupled = compute_policy_loss("vanilla", proximal, current, advantages, mask, importance_weights=same)
    assert decoupled.loss.item() == compute_policy_loss("vanilla", proximal, current, advantages, mask).loss.item()


def test_mismatch_metrics_by_hand():
    # ρ = π_actor / π_rollout: sequence 0 has tokens 2 and 0.5, sequence 1 one token 2, sequence 2 nothing.
    actor = torch.full((3, 3), -1.0, dtype=DTYPE)
    rollout = _rollout_for(actor, [[2.0, 0.5, 100.0], [2.0, 100.0, 100.0], [100.0] * 3])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    metrics = {name: value.item() for name, value in mismatch_metrics(actor, rollout, mask).items()}
    ln2 = math.log(2)
    assert metrics["kl_k3"] == pytest.approx(((2 - 1 - ln2) + (0.5 - 1 + ln2) + (2 - 1 - ln2)) / 3)
    assert metrics["kl_k1"] == pytest.approx((-ln2 + ln2 - ln2) / 3)
    assert metrics["chi2_token"] == pytest.approx((3 - 0.75 + 3) / 3)
    assert metrics["chi2_seq"] == pytest.approx((0 + 3) / 2)  # products 1 and 2; the empty row does not count
    assert metrics["ppl_ratio"] == pytest.approx((1 + 2) / 2)  # geometric means 1 and 2


def test_no_mismatch_gives_zero_divergence_and_ppl_ratio_one():
    old, _, mask = _random_log_probs(2)
    metrics = mismatch_metrics(old, old.clone(), mask)
    assert all(metrics[name].item() == 0 for name in ("kl_k3", "kl_k1", "chi2_token", "chi2_seq"))
    assert metrics["ppl_ratio"].item() == 1


def test_metric_shares_of_micro_batches_add_up_to_the_full_batch():
    old, rollout, mask = _random_log_probs(3)
    correction = RolloutCorrection("token", "mask", low=0.8, high=1.2)
    full = mismatch_metrics(old, rollout, mask) | correction_metrics(
        correction_weights(old, rollout, mask, correction), mask
    )
    counts = dict(tokens=mask.sum(), sequences=mask.any(dim=-1).sum())
    totals = {}
    for rows in (slice(0, 1), slice(1, 4)):
        part = mask[rows]
        shares = mismatch_metrics(old[rows], rollout[rows], part, **counts) | correction_metrics(
            correction_weights(old[rows], rollout[rows], part, correction), part, **counts
        )
        totals = {name: totals.get(name, 0) + value for name, value in shares.items()}
    assert 0 < full["out_of_range_tokens"] < 1  # the range masks some tokens, not all
    for name, value in full.items():
        torch.testing.assert_close(totals[name], value, msg=name)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(level="tokens"), "level='tokens' is not one of"),
        (dict(mode="clip"), "mode='clip' is not one of"),
        (dict(high=0.9), "high=0.9 must be >= 1"),
        (dict(mode="mask", low=1.5), r"low=1.5 must lie in \[0, 1\]"),
        (dict(low=0.5), "low=0.5 with mode='truncate'"),
    ],
)
def test_bad_corrections_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**kwargs)
