"""agg_loss: hand-computed values per mode, padding, and micro-batch invariance with a global normaliser."""

import math

import pytest
import torch

from megarl.algorithms.losses import LOSS_AGG_MODES, agg_loss, agg_loss_normalizer, masked_mean

# Row 1 is a padded sample in the middle of the batch; row 2 is a short response whose padding
# holds garbage (100, NaN) that must not leak into the result.
LOSS = torch.tensor(
    [
        [1.0, 2.0, 3.0, 4.0],
        [7.0, 7.0, 7.0, 7.0],
        [5.0, 6.0, 100.0, math.nan],
    ]
)
MASK = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        # valid tokens 1+2+3+5+6 = 17 over 5 tokens
        ("token-mean", 17 / 5),
        # sequence sums 6 and 11; the empty row 1 is not a sequence: (6 + 11) / 2
        ("seq-mean-token-sum", 17 / 2),
        # sequence means 6/3 = 2 and 11/2 = 5.5: (2 + 5.5) / 2
        ("seq-mean-token-mean", 3.75),
        # (6 + 11) / (2 sequences * T=4)
        ("seq-mean-token-sum-norm", 17 / 8),
    ],
)
def test_agg_loss_hand_values(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_constant_length():
    # (6 + 11) / (2 sequences * 10)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.85)


def test_normalizer_counts_tokens_or_nonempty_sequences():
    assert agg_loss_normalizer(MASK, "token-mean").item() == 5
    for mode in LOSS_AGG_MODES[1:]:
        assert agg_loss_normalizer(MASK, mode).item() == 2


def test_fully_masked_batch_gives_zero_not_nan():
    empty = torch.zeros_like(MASK)
    for mode in LOSS_AGG_MODES:
        assert agg_loss(LOSS, empty, mode).item() == 0.0


def test_masked_mean_ignores_garbage_in_padding():
    # row 0: (1+2+3)/3; row 1: nothing valid -> 0; row 2: (5+6)/2
    torch.testing.assert_close(masked_mean(LOSS, MASK, dim=-1), torch.tensor([2.0, 0.0, 5.5]))


def _random_batch(seed, batch=8, length=6):
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 0, 3, 1, 5, 2, 0, 4])  # includes empty samples mid-batch
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).long()
    return loss, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_normalizer_sum_to_full_batch(mode):
    loss, mask = _random_batch(0)
    loss.requires_grad_(True)
    full = agg_loss(loss, mask, mode, loss_scale_factor=6 if mode == "seq-mean-token-sum-norm" else None)
    (full_grad,) = torch.autograd.grad(full, loss)

    # Two "DP ranks" with two micro-batches each, of unequal sizes and token counts; one micro-batch
    # holds only empty samples.
    pieces = [slice(0, 1), slice(1, 2), slice(2, 5), slice(5, 8)]
    normalizer = sum(agg_loss_normalizer(mask[p], mode) for p in pieces)
    kwargs = {"loss_scale_factor": 6} if mode == "seq-mean-token-sum-norm" else {}
    total = sum(agg_loss(loss[p], mask[p], mode, global_normalizer=normalizer, **kwargs) for p in pieces)
    (total_grad,) = torch.autograd.grad(total, loss)

    torch.testing.assert_close(total, full)
    torch.testing.assert_close(total_grad, full_grad)


def test_micro_batches_without_global_normalizer_differ():
    # Shows the previous test is not trivially true: per-micro-batch means do not add up.
    loss, mask = _random_batch(0)
    pieces = [slice(0, 3), slice(3, 8)]
    local = sum(agg_loss(loss[p], mask[p], "token-mean") for p in pieces)
    assert not torch.isclose(local, agg_loss(loss, mask, "token-mean"))


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        agg_loss(LOSS, MASK, "token-sum")


def test_loss_scale_factor_outside_its_mode_is_rejected():
    with pytest.raises(ValueError, match="only applies to"):
        agg_loss(LOSS, MASK, "token-mean", loss_scale_factor=4)


def test_non_positive_global_normalizer_is_rejected():
    with pytest.raises(ValueError, match="global_normalizer"):
        agg_loss(LOSS, MASK, "token-mean", global_normalizer=0)
