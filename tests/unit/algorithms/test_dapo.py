"""DAPO: dynamic sampling filter and accumulator, overlong reward shaping and overlong filtering."""

import numpy as np
import pytest
import torch

from megarl.algorithms.dapo import (
    DynamicSampler,
    dynamic_sampling_mask,
    filtered_loss_mask,
    overlong_penalty,
    truncated_samples,
)


def test_mask_drops_all_equal_groups_and_singletons():
    # a: 1, 0 -> kept; b: 1, 1 -> dropped; c: single sample -> dropped; d: 0, 0, 0.3 -> kept
    index = ["a", "b", "a", "b", "c", "d", "d", "d"]
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.3])
    keep = dynamic_sampling_mask(index, rewards)
    assert keep.tolist() == [True, False, True, False, False, True, True, True]


def test_sampler_fills_the_step_across_rounds_and_trims_extra_groups():
    sampler = DynamicSampler(groups_per_step=3, max_rounds=3)
    # round 1: r1-a varies, r1-b does not -> 1 group kept
    keep = sampler.add(["r1-a", "r1-a", "r1-b", "r1-b"], torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert keep.tolist() == [True, True, False, False]
    assert (sampler.groups_kept, sampler.done) == (1, False)
    # round 2: three varying groups, only two are needed: the first two (in batch order) are kept
    keep = sampler.add(["r2-c", "r2-a", "r2-a", "r2-c", "r2-b", "r2-b"], torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]))
    assert keep.tolist() == [True, True, True, True, False, False]
    assert (sampler.groups_kept, sampler.groups_seen, sampler.rounds, sampler.done) == (3, 5, 2, True)


def test_sampler_raises_naming_the_setting_when_rounds_run_out():
    sampler = DynamicSampler(groups_per_step=2, max_rounds=2)
    sampler.add(["r1-a", "r1-a"], torch.tensor([1.0, 1.0]))
    with pytest.raises(
        RuntimeError, match=r"kept 0 of 2 groups after 2 rollout rounds \(algorithm\.dynamic_sampling\.max_rounds=2\)"
    ):
        sampler.add(["r2-a", "r2-a"], torch.tensor([0.0, 0.0]))


def test_sampler_rejects_a_group_id_reused_across_rounds():
    sampler = DynamicSampler(groups_per_step=2, max_rounds=3)
    sampler.add(["a", "a"], torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="'a' was already kept"):
        sampler.add(["a", "a"], torch.tensor([1.0, 0.0]))


def test_sampler_refuses_rounds_after_it_is_done():
    sampler = DynamicSampler(groups_per_step=1, max_rounds=1)
    sampler.add(["a", "a"], torch.tensor([1.0, 0.0]))
    with pytest.raises(RuntimeError, match="already has all its groups"):
        sampler.add(["b", "b"], torch.tensor([1.0, 0.0]))


def test_overlong_penalty_hand_values():
    # max 20, buffer 4: no penalty up to 16, then -(L - 16) / 4 * factor, capped at -factor
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    torch.testing.assert_close(
        overlong_penalty(lengths, max_response_length=20, buffer_length=4, penalty_factor=1.0),
        torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]),
    )
    torch.testing.assert_close(
        overlong_penalty(lengths, max_response_length=20, buffer_length=4, penalty_factor=0.5),
        torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]),
    )


@pytest.mark.parametrize("buffer_length", [0, 21])
def test_overlong_buffer_must_fit(buffer_length):
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), max_response_length=20, buffer_length=buffer_length, penalty_factor=1.0)


def test_mask_accepts_tensor_and_numpy_ids():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    expected = [True, True, False, False]
    assert dynamic_sampling_mask(torch.tensor([3, 3, 4, 4]), rewards).tolist() == expected
    assert dynamic_sampling_mask(np.array(["u", "u", "v", "v"]), rewards).tolist() == expected


def test_truncated_samples_are_those_the_rollout_cut_at_a_length_limit():
    assert truncated_samples(["length", "stop", "stop", "length"]).tolist() == [True, False, False, True]


def test_the_filtered_loss_mask_drops_truncated_rows_only():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    filtered = filtered_loss_mask(mask, torch.tensor([False, True, False]))
    assert filtered.tolist() == [[True, True, False], [False, False, False], [True, False, True]]
