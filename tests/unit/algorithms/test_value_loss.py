"""Clipped value loss and the entropy term."""

import math

import pytest
import torch

from megarl.algorithms.value_loss import compute_entropy_loss, compute_value_loss


def test_value_loss_hand_values():
    # cliprange 0.2; (V, V_old, R) -> clip(V, V_old -+ .2); (V - R)^2, (Vclip - R)^2; max
    #   (1.0, 0.8, 1.5) -> 1.0; .25, .25 -> .25   not clipped
    #   (2.0, 2.5, 1.0) -> 2.3; 1.0, 1.69 -> 1.69 clipped
    #   (0.5, 0.5, 0.0) -> 0.5; .25, .25 -> .25   not clipped
    #   (3.0, 2.0, 2.0) -> 2.2; 1.0, .04 -> 1.0   not clipped (PPO keeps the larger loss)
    #   padding (100) ignored
    # 0.5 * (.25 + 1.69 + .25 + 1.0) / 4 = 0.39875; clip_frac 1/4
    vpreds = torch.tensor([[1.0, 2.0, 0.5], [3.0, 100.0, 0.0]], requires_grad=True)
    values = torch.tensor([[0.8, 2.5, 0.5], [2.0, 0.0, 0.0]])
    returns = torch.tensor([[1.5, 1.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, clip_frac = compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.2, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(0.39875)
    assert clip_frac.item() == pytest.approx(0.25)
    # gradient: 0.5 * 2 * (V - R) / 4 where unclipped wins, 0 where the clipped term wins
    loss.backward()
    torch.testing.assert_close(vpreds.grad, torch.tensor([[-0.125, 0.0, 0.125], [0.25, 0.0, 0.0]]))


def test_value_loss_with_global_normalizer_sums_over_micro_batches():
    gen = torch.Generator().manual_seed(0)
    vpreds, values, returns = (torch.randn(4, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = (torch.arange(5) < torch.tensor([[5], [2], [0], [3]])).long()
    full, _ = compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.3, loss_agg_mode="token-mean")
    halves = [slice(0, 2), slice(2, 4)]
    total = sum(
        compute_value_loss(
            vpreds[p],
            values[p],
            returns[p],
            mask[p],
            cliprange_value=0.3,
            loss_agg_mode="token-mean",
            global_normalizer=int(mask.sum()),
        )[0]
        for p in halves
    )
    torch.testing.assert_close(total, full)


def test_entropy_hand_values():
    # token 0: uniform over 3 -> ln 3; token 1: p = (.5, .25, .25) -> .5 ln 2 + 2 * .25 ln 4 = 1.5 ln 2;
    # token 2 is padding with NaN logits and must not count. token-mean (ln 3 + 1.5 ln 2) / 2.
    logits = torch.stack(
        [torch.zeros(3), torch.tensor([0.5, 0.25, 0.25]).log() + 7.0, torch.full((3,), math.nan)]
    ).unsqueeze(0)
    entropy = compute_entropy_loss(logits, torch.tensor([[1, 1, 0]]), "token-mean")
    assert entropy.item() == pytest.approx((math.log(3) + 1.5 * math.log(2)) / 2)
