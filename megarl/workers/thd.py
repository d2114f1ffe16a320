"""megatron-core's THD layout, the micro-batches of the Transformer Engine spec: a micro-batch's
samples back to back in one row `[1, t]` (each sample's real tokens only), with `cu_seqlens`, the
offsets where each sample starts, in place of an attention mask.

What megatron-core 0.16.1 does with it, given `GPTModel.forward(..., attention_mask=None,
packed_seq_params=PackedSeqParams(qkv_format="thd", ...))` (`MicroBatch.packed_seq_params`):
- RoPE: `RotaryEmbedding.get_rotary_seq_len` sizes the table by `max_seqlen`, and
  `SelfAttention.forward` (megatron/core/transformer/attention.py) squeezes the batch dimension
  (q, k, v `[t, heads, dim]`) and applies it per sequence, in TE's fused THD kernel (megarl sets
  `apply_rope_fusion` on this spec: `megarl.models.architectures.rope_fusion`, which says why):
  every sample gets positions `0..len-1`, as alone.
- Attention: `TEDotProductAttention.forward` (megatron/core/extensions/transformer_engine.py) hands
  `cu_seqlens_q/kv` and `max_seqlen_q/kv` to TE's `DotProductAttention` and turns the spec's `causal`
  into `padding_causal` (the mask types TE's THD kernels take): causal inside each sequence, nothing
  across them, no score outside a sample computed.
- The last stage returns `[1, t, ...]`: `response_index` reads it as it reads a packed row.

Padding. megatron-core's own rule for THD (megatron/core/models/multimodal/context_parallel.py,
`get_padding`): a multiple of 2·CP with context parallelism, of TP with sequence parallelism (which
splits the tokens over TP ranks), of 16 with FP8 (32 with MXFP8), else none. Of these megarl runs
sequence parallelism and context parallelism: the row's end is padded to a multiple of TP, times 2·CP
with CP (`megatron_train.sequence_multiple`, `micro_batches.pad_sequence`: one more `cu_seqlens`
sequence); with CP every sample's sequence is padded at its end to a multiple of 2·CP too (its 2·CP
chunks, `megarl.workers.context_parallel`; the padding is inside the sequence, after its tokens, so
causal attention keeps it from every real token); otherwise samples are never padded. Pipeline stages
exchange one shape: there the row is padded at its
end to `num_tokens`, and that padding is one more sequence of `cu_seqlens` (it attends to itself;
nothing reads it), so the sequences always cover the row as RoPE's split needs, with no padding
between sequences (`cu_seqlens_q_padded`). Samples without tokens get no sequence.
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.workers.batch import PolicyBatch
from megarl.workers.micro_batches import (
    MicroBatch,
    consecutive_rows,
    packed_micro_batch,
    sample_spans,
    token_counts,
)
from megarl.workers.packing import TokenBudget, pack_by_tokens


def thd_micro_batch(
    samples: PolicyBatch, rows: torch.Tensor, *, num_tokens: int | None, sample_multiple: int = 1
) -> MicroBatch:
    """`samples` (the batch's `rows`) back to back in one row, each taking a multiple of `sample_multiple`
    tokens (its real tokens, then padding inside its sequence), the row padded at its end to `num_tokens`
    (None: no padding)."""
    micro_batch = packed_micro_batch(
        samples, rows, [len(samples)], row_length=num_tokens, num_rows=None, sample_multiple=sample_multiple
    )
    spans = sample_spans(token_counts(samples).sum(dim=1).tolist(), sample_multiple)
    offsets = sequence_offsets(spans, micro_batch.input_ids.shape[1])
    return dataclasses.replace(
        micro_batch,
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=micro_batch.input_ids.device),
        max_seqlen=max((end - start for start, end in zip(offsets, offsets[1:])), default=0),
    )


def sequence_offsets(lengths: list[int], row_tokens: int) -> list[int]:
    """`cu_seqlens` of a row of `row_tokens` holding samples of `lengths` tokens from its start: 0,
    then the end of each non-empty sample, then `row_tokens` if padding follows them."""
    offsets = [0]
    for length in lengths:
        if length > 0:
            offsets.append(offsets[-1] + length)
    if offsets[-1] < row_tokens:
        offsets.append(row_tokens)
    return offsets


def cut_thd_micro_batches(
    batch: PolicyBatch, cut: int | TokenBudget, *, fixed_shape: bool, sample_multiple: int = 1, row_multiple: int = 1
) -> list[MicroBatch]:
    """`batch` as THD micro-batches: `cut` consecutive samples each (`cut` must divide `len(batch)`),
    or packed under a `TokenBudget` (`pack_by_tokens`: one row of up to the budget's tokens, as no
    score outside a sample is computed).

    `sample_multiple`: every sample's sequence takes a multiple of it of tokens (2 × CP under context
    parallelism; its padding counts against the budget). `fixed_shape`: every micro-batch is
    `[1, num_tokens]` (megatron's pipeline schedule sends one shape between stages): the budget, or the
    `cut` samples' padded size, rounded up to `row_multiple` (what `micro_batches.pad_sequence` pads to).
    """
    if isinstance(cut, TokenBudget):
        plan = pack_by_tokens(sample_spans(token_counts(batch).sum(dim=1).tolist(), sample_multiple), cut)
        selections = [torch.tensor(indices, dtype=torch.long) for indices in plan]
        num_tokens = cut.max_tokens
    else:
        selections = consecutive_rows(len(batch), cut)
        num_tokens = cut * sample_spans([batch.prompt_length + batch.response_length], sample_multiple)[0]
    num_tokens = -(-num_tokens // row_multiple) * row_multiple
    return [
        thd_micro_batch(
            batch.select(rows),
            rows,
            num_tokens=num_tokens if fixed_shape else None,
            sample_multiple=sample_multiple,
        )
        for rows in selections
    ]
