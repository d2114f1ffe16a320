"""PolicyBatch layout and its padded micro-batches: masks, the response columns, cutting into
mini-/micro-batches."""

import pytest
import torch

from megarl.workers.batch import PolicyBatch, mini_batches
from megarl.workers.micro_batches import padded_micro_batch


def attention_mask(batch: PolicyBatch) -> torch.Tensor:
    return padded_micro_batch(batch, torch.arange(len(batch))).attention_mask()


def _batch(rows: int = 4) -> PolicyBatch:
    """Row i: prompt of length 3 - i % 3 (left-padded to 3), response of length 1 + i % 2 (right-padded to 2)."""
    prompt_lens = torch.tensor([3 - i % 3 for i in range(rows)])
    response_lens = torch.tensor([1 + i % 2 for i in range(rows)])
    return PolicyBatch(
        prompts=torch.arange(rows * 3).reshape(rows, 3) + 10,
        prompt_mask=torch.arange(3)[None, :] >= (3 - prompt_lens)[:, None],
        responses=torch.arange(rows * 2).reshape(rows, 2) + 50,
        response_mask=torch.arange(2)[None, :] < response_lens[:, None],
        advantages=torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2),
    )


def test_attention_mask_is_causal_and_hides_prompt_padding_keys():
    batch = _batch()
    mask = attention_mask(batch)  # True = masked out
    assert mask.shape == (4, 1, 5, 5) and mask.dtype == torch.bool
    # Row 1: prompt [pad, p, p], response [r, r]: keys 0 (pad) and anything in the future are hidden
    # from real queries; the padding query sees only padding (finite, never read).
    expected = torch.tensor(
        [
            [0, 1, 1, 1, 1],
            [1, 0, 1, 1, 1],
            [1, 0, 0, 1, 1],
            [1, 0, 0, 0, 1],
            [1, 0, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[1, 0], expected)
    # Row 2: prompt [pad, pad, p], response [r, pad]: the response token sees p and itself; the
    # right padding (column 4) is in its future.
    assert torch.equal(mask[2, 0, 3], torch.tensor([True, True, False, False, True]))
    # A loss mask with a hole leaves attention alone.
    holed = _batch()
    holed.response_mask[1, 0] = False
    assert torch.equal(attention_mask(holed), mask)


def test_response_index_reads_the_position_before_each_response_token():
    batch = _batch()
    micro_batch = padded_micro_batch(batch, torch.arange(len(batch)))
    # Row i's response token t is predicted at column 2 + t of row i (flattened: 5 i + 2 + t).
    assert torch.equal(micro_batch.response_index, torch.tensor([[5 * i + 2, 5 * i + 3] for i in range(4)]))
    # The output at flat column c predicts input column c + 1: here, every response token.
    predicted = micro_batch.input_ids.flatten()[micro_batch.response_index + 1]
    assert torch.equal(predicted, batch.responses)
    assert torch.equal(micro_batch.position_ids[3], torch.arange(5))


def test_select_and_split_keep_every_field_aligned():
    batch = _batch(6)
    parts = batch.split(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert torch.equal(parts[1].advantages, batch.advantages[2:4])
    assert torch.equal(parts[2].response_mask, batch.response_mask[4:])
    assert parts[0].returns is None
    picked = batch.select(torch.tensor([5, 0]))
    assert torch.equal(picked.prompts, batch.prompts[[5, 0]])
    with pytest.raises(ValueError, match="cannot cut a batch of 6 samples into 4"):
        batch.split(4)


def test_rows_and_mask_shapes_are_checked():
    batch = _batch()
    with pytest.raises(ValueError, match="advantages has 3 rows but prompts has 4"):
        PolicyBatch(
            batch.prompts, batch.prompt_mask, batch.responses, batch.response_mask, advantages=torch.zeros(3, 2)
        )
    with pytest.raises(ValueError, match=r"update needs PolicyBatch fields \['old_log_probs'\]"):
        batch.require(("advantages", "old_log_probs"), "update")
    with pytest.raises(ValueError, match="masks must match"):
        PolicyBatch(batch.prompts, batch.prompt_mask[:, :2], batch.responses, batch.response_mask)


def test_mini_batches_shuffle_is_a_seeded_permutation():
    batch = _batch(8)
    in_order = mini_batches(batch, 2, shuffle_seed=None)
    assert torch.equal(in_order[0].prompts, batch.prompts[:4])
    first = torch.cat([m.prompts for m in mini_batches(batch, 4, shuffle_seed=11)])
    again = torch.cat([m.prompts for m in mini_batches(batch, 4, shuffle_seed=11)])
    other = torch.cat([m.prompts for m in mini_batches(batch, 4, shuffle_seed=12)])
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert sorted(first[:, 0].tolist()) == sorted(batch.prompts[:, 0].tolist())


def test_model_inputs_are_made_on_the_batch_device():
    """The meta device stands in for CUDA: `megatron_train` moves each micro-batch to the
    compute device and `run_model` builds the attention mask from it, so any tensor made on the CPU
    would meet the batch's masks on another device (an error on meta as on CUDA)."""
    batch = _batch().to(torch.device("meta"))
    micro_batch = padded_micro_batch(batch, torch.arange(len(batch), device="meta"))
    mask, positions = micro_batch.attention_mask(), micro_batch.position_ids
    assert mask.device.type == "meta" and mask.shape == (4, 1, 5, 5)
    assert positions.device.type == "meta" and positions.shape == (4, 5)
    assert batch.input_ids.device.type == "meta"
    shuffled = mini_batches(batch, 2, shuffle_seed=0)
    assert all(part.prompts.device.type == "meta" for part in shuffled)
