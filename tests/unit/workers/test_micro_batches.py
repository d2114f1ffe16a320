"""Packed micro-batches: the real tokens of each sample one after another, attention inside a sample
only, each response token read from the column before it; padded ones as the batch lays them out."""

import pytest
import torch

from megarl.workers.micro_batches import PADDING_SEGMENT, cut_micro_batches, packed_micro_batch, token_counts
from megarl.workers.packing import TokenBudget
from tests.unit.workers.three_samples import three_samples


def test_tokens_are_the_prompt_and_the_response_up_to_its_last_counted_token():
    assert token_counts(three_samples()).tolist() == [[3, 2], [1, 3], [2, 0]]


def test_a_packed_row_holds_each_sample_once_and_reads_each_response_token_before_it():
    batch = three_samples()
    packed = packed_micro_batch(batch, torch.arange(3), [3], row_length=None, num_rows=None)
    # The masked-out middle token of sample 1 stays: the token after it counts and reads it.
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 24, 31, 32]]
    assert packed.segment_ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]]
    mask = batch.response_mask
    predicted = packed.input_ids.flatten()[packed.response_index[mask] + 1]
    assert torch.equal(predicted, batch.responses[mask])
    # Uncounted positions point inside their own sample (finite numbers nobody reads).
    assert packed.response_index.tolist() == [[2, 3, 4], [5, 6, 7], [10, 10, 10]]


def test_attention_stays_inside_each_sample_and_is_causal():
    packed = packed_micro_batch(three_samples(), torch.arange(3), [3], row_length=14, num_rows=None)
    mask = packed.attention_mask()[0, 0]  # True = masked out
    assert mask.shape == (14, 14)
    segments = packed.segment_ids[0]
    assert segments[11:].tolist() == [PADDING_SEGMENT] * 3 and packed.input_ids.shape == (1, 14)
    for query in range(14):
        visible = [key for key in range(14) if not mask[query, key]]
        assert visible == [key for key in range(query + 1) if segments[key] == segments[query]]


def test_a_row_too_short_for_its_tokens_is_refused():
    with pytest.raises(ValueError, match="11 tokens do not fit a row of 10"):
        packed_micro_batch(three_samples(), torch.arange(3), [3], row_length=10, num_rows=None)


def test_a_cut_covers_every_row_once_and_fixed_shapes_pad_to_the_budget():
    batch = three_samples()
    budget = TokenBudget(6, "actor.max_tokens_per_micro_batch")
    micro_batches = cut_micro_batches(batch, budget, fixed_shape=True)
    assert sorted(row for m in micro_batches for row in m.rows.tolist()) == [0, 1, 2]
    assert {m.input_ids.shape for m in micro_batches} == {(1, 6)}
    for m in micro_batches:
        assert torch.equal(m.samples.responses, batch.responses[m.rows])
    padded = cut_micro_batches(batch, 3, fixed_shape=False)
    assert len(padded) == 1 and padded[0].input_ids.shape == (3, 6)
    with pytest.raises(ValueError, match="micro_batch_size=2 must divide the 3 samples"):
        cut_micro_batches(batch, 2, fixed_shape=False)


def test_a_micro_batch_holds_several_rows_no_wider_than_the_paddedthree_samples():
    batch = three_samples()  # 5, 4 and 2 tokens; padded width 6
    budget = TokenBudget(12, "actor.max_tokens_per_micro_batch")
    [packed] = cut_micro_batches(batch, budget, fixed_shape=False)
    assert packed.rows.tolist() == [0, 1, 2]
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15, 0], [21, 22, 23, 24, 31, 32]]
    assert packed.segment_ids.tolist() == [[0, 0, 0, 0, 0, PADDING_SEGMENT], [1, 1, 1, 1, 2, 2]]
    mask = batch.response_mask
    assert torch.equal(packed.input_ids.flatten()[packed.response_index[mask] + 1], batch.responses[mask])
    # Fixed shapes: as many full-width rows as the budget holds (here 2 of 6).
    [fixed] = cut_micro_batches(batch, TokenBudget(13, "actor.max_tokens_per_micro_batch"), fixed_shape=True)
    assert fixed.input_ids.shape == (2, 6)


def _graph_ops(tensor: torch.Tensor) -> set[str]:
    """The names of the autograd nodes `tensor` was computed through."""
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node.name() not in seen:
            seen.add(node.name())
            stack.extend(next_node for next_node, _ in node.next_functions)
    return seen


@pytest.mark.parametrize("width", [6, 8])  # as cut, and padded at the rows' end (sequence parallelism)
def test_a_padded_micro_batch_reads_its_responses_through_a_view_not_a_gather(width):
    """The update's log-probs read the logits of the response columns: a padded micro-batch reads them as
    a slice, whose backward copies, not through `response_index`, whose backward is an accumulating scatter
    over `[b, R, V]` (single-threaded on CPU). The same numbers and the same gradient either way."""
    from megarl.workers.micro_batches import pad_sequence

    micro_batch = pad_sequence(cut_micro_batches(three_samples(), 3, fixed_shape=False)[0], width)
    output = torch.randn(3, width, 5, requires_grad=True)  # [r, T, V]
    read = micro_batch.response_outputs(output)
    gathered = output.flatten(0, 1)[micro_batch.response_index]
    assert torch.equal(read, gathered)
    assert _graph_ops(read) == {"SliceBackward0", "torch::autograd::AccumulateGrad"}  # the leaf `output`
    assert "IndexBackward0" in _graph_ops(gathered)
    weights = torch.randn(read.shape)
    (view_grad,) = torch.autograd.grad((read * weights).sum(), output)
    (gather_grad,) = torch.autograd.grad((gathered * weights).sum(), output)
    assert torch.equal(view_grad, gather_grad)


def test_packed_micro_batches_read_through_their_index():
    packed = packed_micro_batch(three_samples(), torch.arange(3), [3], row_length=None, num_rows=None)
    output = torch.randn(1, 11, 5)
    assert packed.response_columns is None
    assert torch.equal(packed.response_outputs(output), output.flatten(0, 1)[packed.response_index])
