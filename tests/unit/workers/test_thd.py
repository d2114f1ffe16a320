"""THD micro-batches (the Transformer Engine spec's layout): one row of back-to-back samples,
`cu_seqlens` where each starts, no mask, and each response token read from the column before it."""

import pytest
import torch

from megarl.workers.batch import PolicyBatch
from megarl.workers.micro_batches import cut_micro_batches, token_counts
from megarl.workers.packing import TokenBudget
from megarl.workers.thd import cut_thd_micro_batches, sequence_offsets, thd_micro_batch
from tests.unit.workers.three_samples import three_samples


def test_one_row_of_samples_with_their_offsets_and_no_mask():
    batch = three_samples()
    thd = thd_micro_batch(batch, torch.arange(3), num_tokens=None)
    assert thd.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 24, 31, 32]]
    assert thd.cu_seqlens.dtype == torch.int32 and thd.cu_seqlens.tolist() == [0, 5, 9, 11]
    assert thd.max_seqlen == 5 and thd.attention_mask() is None
    mask = batch.response_mask
    predicted = thd.input_ids.flatten()[thd.response_index[mask] + 1]
    assert torch.equal(predicted, batch.responses[mask])
    params = thd.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q is params.cu_seqlens_kv is thd.cu_seqlens
    assert params.max_seqlen_q == params.max_seqlen_kv == 5
    assert params.cu_seqlens_q_padded is None  # no padding between sequences


def test_end_padding_is_one_more_sequence_and_empty_samples_get_none():
    assert sequence_offsets([5, 0, 4], 9) == [0, 5, 9]
    assert sequence_offsets([5, 0, 4], 16) == [0, 5, 9, 16]
    thd = thd_micro_batch(three_samples(), torch.arange(3), num_tokens=16)
    assert thd.input_ids.shape == (1, 16) and thd.cu_seqlens.tolist() == [0, 5, 9, 11, 16]


def test_dense_layouts_keep_their_mask_and_have_no_packed_seq_params():
    [dense] = cut_micro_batches(three_samples(), 3, fixed_shape=False)
    assert dense.packed_seq_params() is None and dense.attention_mask().shape == (3, 1, 6, 6)


@pytest.mark.parametrize("fixed_shape", [False, True])
def test_a_budget_cut_covers_every_sample_once_within_the_budget(fixed_shape):
    batch = three_samples()
    lengths = token_counts(batch).sum(dim=1)
    budget = TokenBudget(6, "actor.max_tokens_per_micro_batch")
    micro_batches = cut_thd_micro_batches(batch, budget, fixed_shape=fixed_shape)
    assert sorted(row for m in micro_batches for row in m.rows.tolist()) == [0, 1, 2]
    for micro_batch in micro_batches:
        tokens = int(lengths[micro_batch.rows].sum())
        assert micro_batch.input_ids.shape == (1, 6 if fixed_shape else tokens)
        assert micro_batch.cu_seqlens[-1] == micro_batch.input_ids.shape[1]


def test_a_sample_count_cut_takes_consecutive_samples():
    batch = three_samples()
    twice = PolicyBatch(
        *(torch.cat([t, t]) for t in (batch.prompts, batch.prompt_mask, batch.responses, batch.response_mask))
    )
    [first, second] = cut_thd_micro_batches(twice, 3, fixed_shape=True)
    assert first.rows.tolist() == [0, 1, 2] and second.rows.tolist() == [3, 4, 5]
    assert first.input_ids.shape == (1, 18)  # 3 samples of 3 + 3 columns
    with pytest.raises(ValueError, match="micro_batch_size=2 must divide the 3 samples"):
        cut_thd_micro_batches(batch, 2, fixed_shape=False)


def test_the_reward_model_reads_each_samples_last_token_in_either_layout():
    """`last_token_scores` with the token ids as the head's output: the last kept response token
    (sample 0: 15; sample 1: 24, the response's last column), else the prompt's last (sample 2: 32)."""
    from megarl.workers.micro_batches import padded_micro_batch
    from megarl.workers.reward_model import last_token_scores

    batch = three_samples()
    rows = torch.arange(3)
    for micro_batch in (padded_micro_batch(batch, rows), thd_micro_batch(batch, rows, num_tokens=16)):
        output = micro_batch.input_ids[..., None].float()  # [r, T, 1]
        assert last_token_scores(output, micro_batch).tolist() == [15, 24, 32]
