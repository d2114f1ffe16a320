"""KL estimators, the reward penalty, the KL loss term and the coefficient controllers."""

import math

import pytest
import torch

from megarl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    kl_penalty,
)

LOG_PROB = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
REF_LOG_PROB = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)  # log-ratios 0.5 and -1


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("k2", [0.125, 0.5]),  # 0.5 * 0.5^2, 0.5 * 1^2
        # x = log(pi_ref / pi) = -0.5, 1: e^x - x - 1
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_estimators_hand_values(kind, expected):
    torch.testing.assert_close(kl_penalty(LOG_PROB, REF_LOG_PROB, kind), torch.tensor([expected], dtype=torch.float64))


@pytest.mark.parametrize("alias, name", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_verl_aliases(alias, name):
    torch.testing.assert_close(kl_penalty(LOG_PROB, REF_LOG_PROB, alias), kl_penalty(LOG_PROB, REF_LOG_PROB, name))


def test_k3_is_clamped():
    # log-ratio -30: x = 30 is clamped to 20, e^20 - 21 then to 10.
    # log-ratio +30: x = -30 -> -20: e^-20 + 19 ~ 19, clamped to 10.
    log_prob = torch.tensor([[-30.0, 0.0]])
    ref_log_prob = torch.tensor([[0.0, -30.0]])
    torch.testing.assert_close(kl_penalty(log_prob, ref_log_prob, "k3"), torch.tensor([[10.0, 10.0]]))


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as error:
        kl_penalty(LOG_PROB, REF_LOG_PROB, "k4")
    for name in KL_ESTIMATORS:
        assert name in str(error.value)


def test_apply_kl_penalty_hand_values():
    # k1 log-ratios row 0: .1 .2 .3; row 1: .4 -.2 and 9 in padding. coef 0.5:
    # rewards = scores - 0.5 * kl on valid tokens; padding untouched.
    # current_kl = mean of per-sequence means = (0.2 + 0.1) / 2 = 0.15
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    ref_log_prob = torch.full((2, 3), -1.0, dtype=torch.float64)
    log_prob = ref_log_prob + torch.tensor([[0.1, 0.2, 0.3], [0.4, -0.2, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, current_kl = apply_kl_penalty(scores, log_prob, ref_log_prob, mask, kl_coef=0.5, kind="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 2.1, 0.0]], dtype=torch.float64))
    assert current_kl.item() == pytest.approx(0.15)


def test_kl_loss_hand_value_and_gradient():
    # k2 of log-ratios .1 .2 .3 .4 -.2 = .005 .02 .045 .08 .02 -> token-mean .17 / 5.
    # d/d log pi of 0.5 * x^2 / 5 = x / 5.
    log_ratio = torch.tensor([[0.1, 0.2, 0.3], [0.4, -0.2, 9.0]], dtype=torch.float64)
    ref_log_prob = torch.full((2, 3), -1.0, dtype=torch.float64)
    log_prob = (ref_log_prob + log_ratio).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss = compute_kl_loss(log_prob, ref_log_prob, mask, "k2", "token-mean")
    assert loss.item() == pytest.approx(0.034)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, log_ratio * mask / 5)


def test_fixed_controller_never_moves():
    controller = FixedKLController(kl_coef=0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05


@pytest.mark.parametrize(
    "current_kl, expected",
    [
        (9.0, 0.1 * (1 + 0.2 * 256 / 10000)),  # 9/6 - 1 = 0.5, clipped to 0.2
        (3.0, 0.1 * (1 - 0.2 * 256 / 10000)),  # 3/6 - 1 = -0.5, clipped to -0.2
        (6.6, 0.1 * (1 + 0.1 * 256 / 10000)),  # 6.6/6 - 1 = 0.1, inside the band
    ],
)
def test_adaptive_controller_hand_values(current_kl, expected):
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    controller.update(current_kl=current_kl, n_steps=256)
    assert controller.value == pytest.approx(expected)


def test_adaptive_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=0)


def test_apply_kl_penalty_keeps_nan_in_padding_out_of_rewards():
    scores = torch.tensor([[0.0, 1.0, 0.0]])
    log_prob = torch.tensor([[-1.0, -1.0, math.nan]])
    ref_log_prob = torch.tensor([[-1.0, -1.5, -1.0]])
    rewards, current_kl = apply_kl_penalty(scores, log_prob, ref_log_prob, torch.tensor([[1, 1, 0]]), 0.1, "k1")
    # token 1: 1 - 0.1 * 0.5; padding keeps its score 0; current_kl = (0 + 0.5) / 2
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.95, 0.0]]))
    assert current_kl.item() == pytest.approx(0.25)
