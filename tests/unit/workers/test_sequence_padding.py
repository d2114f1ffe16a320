"""Padding a micro-batch's rows to a multiple of TP for sequence parallelism (`pad_sequence`): the new
columns are padding no sample sees, each response token is still read from the column before it, and
a THD row gets the padding as one more `cu_seqlens` sequence."""

import pytest
import torch

from megarl.workers.micro_batches import PADDING_SEGMENT, cut_micro_batches, pad_sequence
from megarl.workers.packing import TokenBudget
from megarl.workers.thd import thd_micro_batch
from tests.unit.workers.three_samples import three_samples


def _predicted(micro_batch, mask):
    """The token after each masked response token's predicting column (the token it predicts)."""
    return micro_batch.input_ids.flatten()[micro_batch.response_index[mask] + 1]


@pytest.mark.parametrize("cut", [3, TokenBudget(7, "actor.max_tokens_per_micro_batch")], ids=["padded", "packed"])
@pytest.mark.parametrize("multiple", [2, 4])
def test_dense_rows_widen_with_padding_and_keep_their_outputs(cut, multiple):
    batch = three_samples()
    for micro_batch in cut_micro_batches(batch, cut, fixed_shape=False):
        padded = pad_sequence(micro_batch, multiple)
        rows, width = micro_batch.input_ids.shape
        assert padded.input_ids.shape == (rows, -(-width // multiple) * multiple)
        assert torch.equal(padded.input_ids[:, :width], micro_batch.input_ids)
        assert (padded.segment_ids[:, width:] == PADDING_SEGMENT).all()
        samples = micro_batch.samples
        mask = samples.response_mask
        assert torch.equal(_predicted(padded, mask), samples.responses[mask])
        # Every real token attends to exactly what it attended to before, and never to the new columns.
        mask_before, mask_after = micro_batch.attention_mask(), padded.attention_mask()
        assert torch.equal(mask_after[..., :width, :width], mask_before)
        real = micro_batch.segment_ids != PADDING_SEGMENT  # [r, T]
        assert mask_after[:, 0, :width, width:][real].all()


def test_a_width_the_multiple_divides_is_left_alone():
    [micro_batch] = cut_micro_batches(three_samples(), 3, fixed_shape=False)  # rows of 6
    assert pad_sequence(micro_batch, 2) is micro_batch and pad_sequence(micro_batch, 1) is micro_batch


def test_a_thd_row_gets_its_padding_as_one_more_sequence():
    thd = thd_micro_batch(three_samples(), torch.arange(3), num_tokens=None)  # 11 tokens: [0, 5, 9, 11]
    padded = pad_sequence(thd, 4)
    assert padded.input_ids.shape == (1, 12) and padded.cu_seqlens.tolist() == [0, 5, 9, 11, 12]
    assert padded.cu_seqlens.dtype == torch.int32 and padded.max_seqlen == 5
    assert padded.attention_mask() is None and torch.equal(padded.response_index, thd.response_index)
    wide = pad_sequence(thd, 8)
    assert wide.cu_seqlens.tolist() == [0, 5, 9, 11, 16] and wide.max_seqlen == 5
