"""Policy losses: every clip branch by hand, importance weights, gradients (gradcheck), micro-batch invariance."""

import math

import pytest
import torch

from megarl.algorithms.losses import agg_loss_normalizer
from megarl.algorithms.policy_loss import POLICY_LOSSES, compute_policy_loss

DTYPE = torch.float64


def _log_probs(ratios, old=-1.0):
    """old_log_prob and log_prob tensors with the given ratios pi / pi_old."""
    ratios = torch.tensor(ratios, dtype=DTYPE)
    old_log_prob = torch.full_like(ratios, old)
    return old_log_prob, old_log_prob + ratios.log()


def test_vanilla_hits_every_branch():
    # clip_ratio_low 0.2, clip_ratio_high 0.28 (DAPO clip-higher), dual clip c = 3.
    #   token  r     A   -A r    -A clip(r, .8, 1.28)  PPO max  dual min(., -3A)  loss   clipped / lower
    #   0     1.10   +1  -1.10   -1.10                 -1.10    -                 -1.10  no / no
    #   1     1.50   +1  -1.50   -1.28                 -1.28    -                 -1.28  yes / no   (upper clip)
    #   2     1.25   +1  -1.25   -1.25                 -1.25    -                 -1.25  no / no    (> 1.2: asymmetric)
    #   3     0.50   -1   0.50    0.80                  0.80    min(.8, 3) = .8    0.80  yes / no   (lower clip)
    #   4     4.00   -1   4.00    1.28                  4.00    min(4, 3) = 3      3.00  no / yes   (dual clip)
    #   5     0.50   +1  -0.50   -0.80                 -0.50    -                 -0.50  no / no    (never clipped up)
    #   6     2.00   -2   4.00    2.56                  4.00    min(4, 6) = 4      4.00  no / no    (r < c)
    #   7     padding (r = 100, A = 5) must not count
    # token-mean = (-1.1 - 1.28 - 1.25 + 0.8 + 3 - 0.5 + 4) / 7 = 3.67 / 7
    ratios = [[1.1, 1.5, 1.25, 0.5], [4.0, 0.5, 2.0, 100.0]]
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0], [-1.0, 1.0, -2.0, 5.0]], dtype=DTYPE)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    old_log_prob, log_prob = _log_probs(ratios)
    out = compute_policy_loss(
        "vanilla", old_log_prob, log_prob, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    assert out.loss.item() == pytest.approx(3.67 / 7)
    assert out.clip_frac.item() == pytest.approx(2 / 7)
    assert out.clip_frac_lower.item() == pytest.approx(1 / 7)
    valid_log_ratios = [math.log(r) for r in [1.1, 1.5, 1.25, 0.5, 4.0, 0.5, 2.0]]
    assert out.approx_kl.item() == pytest.approx(-sum(valid_log_ratios) / 7)


def test_vanilla_extreme_ratios_stay_finite_and_land_on_the_bounds():
    # log-ratios +-30 (clamped to +-20 before exp); clip 0.2, dual clip 3:
    #   +30, A = -1 -> dual clip: 3          +30, A = +1 -> upper clip: -1.2
    #   -30, A = -1 -> lower clip: 0.8       -30, A = +1 -> -e^-20 (PPO never clips this side)
    old_log_prob = torch.zeros(1, 4, dtype=DTYPE)
    log_prob = torch.tensor([[30.0, 30.0, -30.0, -30.0]], dtype=DTYPE, requires_grad=True)
    advantages = torch.tensor([[-1.0, 1.0, -1.0, 1.0]], dtype=DTYPE)
    out = compute_policy_loss("vanilla", old_log_prob, log_prob, advantages, torch.ones(1, 4))
    assert out.loss.item() == pytest.approx((3.0 - 1.2 + 0.8 - math.exp(-20)) / 4)
    assert (out.clip_frac.item(), out.clip_frac_lower.item()) == pytest.approx((0.5, 0.25))
    out.loss.backward()
    assert torch.isfinite(log_prob.grad).all()


def test_symmetric_clip_clips_at_one_point_two():
    # Same token 2 as above (r = 1.25, A = +1) with the default symmetric 0.2: loss -1.2, clipped.
    old_log_prob, log_prob = _log_probs([[1.25]])
    out = compute_policy_loss("vanilla", old_log_prob, log_prob, torch.ones(1, 1, dtype=DTYPE), torch.ones(1, 1))
    assert out.loss.item() == pytest.approx(-1.2)
    assert out.clip_frac.item() == pytest.approx(1.0)


def test_gspo_uses_the_sequence_ratio():
    # Row 0: token log-ratios .1 and .3 -> s = exp(.2) = 1.2214 for both tokens, A = +1, inside
    #   [0.8, 1.28]: token losses -1.2214.
    # Row 1: one valid token with log-ratio .5 (padding holds 50, ignored) -> s = exp(.5) = 1.6487,
    #   A = +1: clipped to 1.28 -> -1.28.
    # seq-mean-token-mean: (-exp(.2) - 1.28) / 2; clipped 1 of 3 valid tokens.
    old_log_prob = torch.full((2, 2), -2.0, dtype=DTYPE)
    log_prob = old_log_prob + torch.tensor([[0.1, 0.3], [0.5, 50.0]], dtype=DTYPE)
    mask = torch.tensor([[1, 1], [1, 0]])
    out = compute_policy_loss(
        "gspo",
        old_log_prob,
        log_prob,
        torch.ones(2, 2, dtype=DTYPE),
        mask,
        clip_ratio_high=0.28,
        loss_agg_mode="seq-mean-token-mean",
    )
    assert out.loss.item() == pytest.approx((-math.exp(0.2) - 1.28) / 2)
    assert out.clip_frac.item() == pytest.approx(1 / 3)
    assert out.clip_frac_lower.item() == 0.0


def test_cispo_weights_log_prob_by_the_clipped_ratio():
    # token 0: r = 1.5 -> clip 1.2, A = +1, log pi = -0.5: -1.2 * 1 * -0.5 = 0.6 (truncated)
    # token 1: r = 1.1,             A = -1, log pi = -2:   -1.1 * -1 * -2 = -2.2
    # token-mean (0.6 - 2.2) / 2 = -0.8; truncated 1 of 2.
    log_prob = torch.tensor([[-0.5, -2.0]], dtype=DTYPE)
    old_log_prob = log_prob - torch.tensor([[1.5, 1.1]], dtype=DTYPE).log()
    out = compute_policy_loss(
        "cispo", old_log_prob, log_prob, torch.tensor([[1.0, -1.0]], dtype=DTYPE), torch.ones(1, 2)
    )
    assert out.loss.item() == pytest.approx(-0.8)
    assert out.clip_frac.item() == pytest.approx(0.5)


def test_cispo_gradient_flows_through_clipped_tokens():
    # d/d log pi of -sg(clip(r)) * A * log pi / N = -clip(r) * A / N: token 0 (clipped) still gets
    # -1.2 * 1 / 2 = -0.6; token 1: -1.1 * -1 / 2 = 0.55.
    log_prob = torch.tensor([[-0.5, -2.0]], dtype=DTYPE, requires_grad=True)
    old_log_prob = (log_prob - torch.tensor([[1.5, 1.1]], dtype=DTYPE).log()).detach()
    out = compute_policy_loss(
        "cispo", old_log_prob, log_prob, torch.tensor([[1.0, -1.0]], dtype=DTYPE), torch.ones(1, 2)
    )
    out.loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.6, 0.55]], dtype=DTYPE))


def test_reinforce_has_no_ratio():
    # -A log pi: -2 * -0.5 = 1 and -1 * -1.5 = 1.5 -> mean 1.25, whatever the (huge) ratio is.
    log_prob = torch.tensor([[-0.5, -1.5]], dtype=DTYPE)
    out = compute_policy_loss(
        "reinforce", log_prob - 5.0, log_prob, torch.tensor([[2.0, 1.0]], dtype=DTYPE), torch.ones(1, 2)
    )
    assert out.loss.item() == pytest.approx(1.25)
    assert out.clip_frac.item() == 0.0


def test_importance_weights_scale_each_token_loss():
    # r = 1, A = +1 -> token loss -1 before the weights 2 and 0.5.
    # token-mean (-2 - 0.5) / 2 = -1.25; gradient -A r w / N = -1, -0.25.
    old_log_prob = torch.tensor([[-1.0, -2.0]], dtype=DTYPE)
    log_prob = old_log_prob.clone().requires_grad_(True)
    out = compute_policy_loss(
        "vanilla",
        old_log_prob,
        log_prob,
        torch.ones(1, 2, dtype=DTYPE),
        torch.ones(1, 2),
        importance_weights=torch.tensor([[2.0, 0.5]], dtype=DTYPE),
    )
    assert out.loss.item() == pytest.approx(-1.25)
    out.loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.0, -0.25]], dtype=DTYPE))


def test_importance_weights_are_constants():
    # The weights correct the sampling distribution; no gradient may flow into them.
    weights = torch.tensor([[math.exp(0.5), math.exp(-1.0)]], dtype=DTYPE, requires_grad=True)
    log_prob = torch.tensor([[-1.2, -1.8]], dtype=DTYPE, requires_grad=True)
    out = compute_policy_loss(
        "reinforce",
        log_prob.detach(),
        log_prob,
        torch.ones(1, 2, dtype=DTYPE),
        torch.ones(1, 2),
        importance_weights=weights,
    )
    out.loss.backward()
    assert weights.grad is None
    torch.testing.assert_close(log_prob.grad, -weights.detach() / 2)  # d/d log pi = -A w / 2


def _random_inputs(seed, log_ratio_scale, batch=3, length=4):
    gen = torch.Generator().manual_seed(seed)
    old_log_prob = -torch.rand(batch, length, generator=gen, dtype=DTYPE) * 3 - 0.5
    sign = torch.where(torch.rand(batch, length, generator=gen) < 0.5, -1.0, 1.0).to(DTYPE)
    # |log ratio| in log_ratio_scale: keeps every ratio a fixed distance from the clip points
    magnitude = log_ratio_scale[0] + torch.rand(batch, length, generator=gen, dtype=DTYPE) * (
        log_ratio_scale[1] - log_ratio_scale[0]
    )
    log_prob = (old_log_prob + sign * magnitude).requires_grad_(True)
    # sequence-level advantages (what outcome estimators produce), bounded away from 0
    advantages = (torch.rand(batch, 1, generator=gen, dtype=DTYPE) + 0.5) * torch.tensor(
        [[1.0], [-1.0], [1.0]], dtype=DTYPE
    )
    advantages = advantages.expand(batch, length)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    return old_log_prob, log_prob, advantages, mask


@pytest.mark.parametrize(
    "name, log_ratio_scale, loss_agg_mode",
    [
        ("vanilla", (0.0, 0.15), "token-mean"),  # inside the clip range
        ("vanilla", (0.3, 0.6), "seq-mean-token-mean"),  # clipped (zero gradient) but not on the edge
        ("gspo", (0.0, 0.15), "seq-mean-token-mean"),  # the paper's aggregation
        ("cispo", (0.3, 0.6), "token-mean"),  # every ratio truncated: the stop-gradient weight is constant
        ("reinforce", (0.0, 0.6), "seq-mean-token-sum"),
    ],
)
def test_gradcheck(name, log_ratio_scale, loss_agg_mode):
    old_log_prob, log_prob, advantages, mask = _random_inputs(0, log_ratio_scale)

    def loss(log_prob):
        return compute_policy_loss(
            name,
            old_log_prob,
            log_prob,
            advantages,
            mask,
            clip_ratio_low=0.2,
            clip_ratio_high=0.25,
            loss_agg_mode=loss_agg_mode,
        ).loss

    assert torch.autograd.gradcheck(loss, (log_prob,))


def test_gradcheck_with_importance_weights():
    old_log_prob, log_prob, advantages, mask = _random_inputs(1, (0.0, 0.15))
    weights = torch.linspace(0.0, 2.0, 12, dtype=DTYPE).reshape(3, 4)

    def loss(log_prob):
        return compute_policy_loss("vanilla", old_log_prob, log_prob, advantages, mask, importance_weights=weights).loss

    assert torch.autograd.gradcheck(loss, (log_prob,))


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batched_loss_and_gradient_equal_full_batch(name, loss_agg_mode):
    old_log_prob, log_prob, advantages, mask = _random_inputs(2, (0.0, 0.6))
    weights = torch.linspace(0.0, 1.2, 12, dtype=DTYPE).reshape(3, 4)
    kwargs = dict(loss_agg_mode=loss_agg_mode, importance_weights=weights)
    full = compute_policy_loss(name, old_log_prob, log_prob, advantages, mask, **kwargs).loss
    (full_grad,) = torch.autograd.grad(full, log_prob)

    pieces = [slice(0, 1), slice(1, 3)]
    normalizer = sum(agg_loss_normalizer(mask[p], loss_agg_mode) for p in pieces)
    total = sum(
        compute_policy_loss(
            name,
            old_log_prob[p],
            log_prob[p],
            advantages[p],
            mask[p],
            global_normalizer=normalizer,
            loss_agg_mode=loss_agg_mode,
            importance_weights=weights[p],
        ).loss
        for p in pieces
    )
    (total_grad,) = torch.autograd.grad(total, log_prob)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(total_grad, full_grad)


def test_unknown_loss_lists_valid_names():
    old_log_prob, log_prob = _log_probs([[1.0]])
    with pytest.raises(ValueError) as error:
        compute_policy_loss("ppo", old_log_prob, log_prob, torch.ones(1, 1, dtype=DTYPE), torch.ones(1, 1))
    for name in POLICY_LOSSES:
        assert name in str(error.value)


def test_importance_weights_need_one_weight_per_token():
    old_log_prob, log_prob = _log_probs([[1.0, 1.0]])
    with pytest.raises(ValueError, match=r"importance_weights has shape \(1, 1\), the log-probs \(1, 2\)"):
        compute_policy_loss(
            "vanilla",
            old_log_prob,
            log_prob,
            torch.ones(1, 2, dtype=DTYPE),
            torch.ones(1, 2),
            importance_weights=torch.ones(1, 1, dtype=DTYPE),
        )


def test_dual_clip_bound_must_exceed_one():
    old_log_prob, log_prob = _log_probs([[1.0]])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(
            "vanilla", old_log_prob, log_prob, torch.ones(1, 1, dtype=DTYPE), torch.ones(1, 1), clip_ratio_c=1.0
        )
