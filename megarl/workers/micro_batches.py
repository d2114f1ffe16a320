"""Micro-batches as the model sees them: padded rows (one sample per row, as the batch is laid out),
packed rows (samples concatenated under a token budget, no padding computed), or one THD row.

All are one `MicroBatch`: `input_ids [r, T]`, each token's sample (`segment_ids`, -1 = padding),
and where each response token's prediction sits in the flattened `[r * T]` output
(`response_index [b, R]`). Attention is causal *within* a segment: a token never sees another
sample's tokens nor padding, so a packed row computes, per sample, what its padded row computes.

Positions. megatron's GPTModel applies RoPE at columns `0..T-1` of a row whatever `position_ids`
says (`megarl.workers.batch`, module docstring); THD restarts them at each sequence. Attention
scores depend only on position differences and a token attends only inside its own sample, so a
sample at offset `o` of a packed row gets the scores it gets at offset 0 (to float rounding), as a
left-padded row already does.

How attention learns the segments depends on the layer spec (`megarl.models.architectures.
takes_thd`): on the local spec a dense block-diagonal `attention_mask()` (megatron's
`FusedScaleMaskSoftmax` applies a given mask as is); the masked scores are computed, so rows are no
wider than the padded batch (`megarl.workers.packing.pack_rows`). On the Transformer Engine spec
megatron-core's THD format (`megarl.workers.thd`): one row, `cu_seqlens` marks where each sample
starts, no mask, and TE's flash/cuDNN kernels compute only the scores inside each sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megarl.workers.batch import PolicyBatch
from megarl.workers.packing import TokenBudget, pack_rows

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.workers.context_shard import ContextShard

PADDING_SEGMENT = -1
"""`segment_ids` of tokens that belong to no sample."""


@dataclass
class MicroBatch:
    """One forward/backward pass of `b` samples laid out as `r` rows of `T` tokens."""

    samples: PolicyBatch
    """The `b` samples (rows of the batch that was cut), in the order of `response_index`."""
    rows: Tensor
    """`[b]` int64 indices of `samples` in the batch that was cut (to put outputs back in order)."""
    input_ids: Tensor
    """`[r, T]` int64 token ids."""
    position_ids: Tensor
    """`[r, T]` int64 position of each token inside its sample's padded or packed layout."""
    segment_ids: Tensor
    """`[r, T]` int64: which of the row's samples a token belongs to; `PADDING_SEGMENT` for padding."""
    response_index: Tensor
    """`[b, R]` int64 index into the `[r * T]` flattened output of the column predicting response
    token `t` of sample `i`; positions past a sample's last counted token point at one of its own
    columns (finite numbers that mean nothing, as the padded layout's)."""
    cu_seqlens: Tensor | None = None
    """THD layout only (`megarl.workers.thd`; then `r` = 1): `[n + 1]` int32 offsets in the row of
    its `n` sequences (each non-empty sample, then the row's end padding if any); None: the dense
    layouts, whose attention `attention_mask()` describes."""
    max_seqlen: int | None = None
    """THD layout only: the longest of the `cu_seqlens` sequences (TE takes it instead of syncing
    with the GPU to find it)."""
    response_columns: slice | None = None
    """Padded layout only (row `i` is sample `i`, `r` = `b`): the columns of every row that predict its
    response tokens, `response_index` as a slice. Read through it, the outputs are a view whose backward
    copies the gradient into place; read through the index, a gather whose backward is an accumulating
    scatter (`index_put_(accumulate=True)`, which PyTorch runs single-threaded on CPU) over `[b, R, V]`.
    None: the packed and THD layouts, read through `response_index`."""
    routed_experts: Tensor | None = None
    """`[r, T, L, k]` int16: `PolicyBatch.routed_experts` in this layout, the rollout's experts of each token
    of `input_ids` in every layer; -1 on padding and on tokens the rollout routed none. None: the batch
    has none."""
    context: ContextShard | None = None
    """THD layout under context parallelism (`megarl.workers.context_parallel`): `input_ids`,
    `position_ids` and `segment_ids` hold this CP rank's `t / CP` columns of the row, which this
    describes; `cu_seqlens`, `max_seqlen` and `response_index` still describe the whole row. None: the
    tensors are the whole row."""

    @property
    def sequence_length(self) -> int:
        """The row's width `T` (under context parallelism the whole row's, as megatron's schedule takes it)."""
        width = self.input_ids.shape[1]
        return width if self.context is None else width * self.context.group.size()

    def attention_mask(self) -> Tensor | None:
        """GPTModel's `attention_mask`: None in the THD layout (attention is causal inside each
        `cu_seqlens` sequence); else `[r, 1, T, T]` bool, True = masked out: the key is in the
        query's future or in another segment (padding is a segment of its own). Queries on padding
        see only padding: finite, unread."""
        if self.cu_seqlens is not None:
            return None
        seq = self.input_ids.shape[1]
        future = torch.ones(seq, seq, dtype=torch.bool, device=self.segment_ids.device).triu(diagonal=1)
        other = self.segment_ids[:, :, None] != self.segment_ids[:, None, :]
        return (future[None] | other)[:, None]

    def padding_mask(self) -> Tensor:
        """GPTModel's `padding_mask`: `[r, T]` bool, True on the tokens of no sample (`PADDING_SEGMENT`),
        which a mixture of experts' router leaves out of its losses, token counts and expert bias
        (megatron/core/transformer/moe/router.py, moe_utils.py: `compute_routing_scores_for_aux_loss`,
        `z_loss_func`); a dense model's layers ignore it."""
        return self.segment_ids == PADDING_SEGMENT

    def packed_seq_params(self) -> PackedSeqParams | None:
        """GPTModel's `packed_seq_params` (megatron/core/packed_seq_params.py): the THD sequences
        for self-attention (queries and keys alike); None in the dense layouts."""
        if self.cu_seqlens is None:
            return None
        # Imported here: the driver imports this module (`token_counts`) and must not load megatron.
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def response_outputs(self, output: Tensor) -> Tensor:
        """`[b, R, ...]` the model output `[r, T, ...]` at each response token's predicting column; under
        context parallelism the output is this rank's `[1, T / CP, ...]`, gathered into the row first."""
        output = self.whole_row(output)
        if self.response_columns is not None:
            return output[:, self.response_columns]
        return output.flatten(0, 1)[self.response_index]

    def whole_row(self, output: Tensor) -> Tensor:
        """`[r, T, ...]` the model output over the whole rows: `output` itself, or under context parallelism
        every CP rank's columns gathered from this rank's `[1, T / CP, ...]` (`ContextShard.gather`)."""
        return output if self.context is None else self.context.gather(output)

    def to(self, device: torch.device) -> MicroBatch:
        """The micro-batch with every tensor on `device`."""
        return MicroBatch(
            self.samples.to(device),
            self.rows.to(device),
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.segment_ids.to(device),
            self.response_index.to(device),
            None if self.cu_seqlens is None else self.cu_seqlens.to(device),
            self.max_seqlen,
            self.response_columns,
            routed_experts=None if self.routed_experts is None else self.routed_experts.to(device),
            context=None if self.context is None else self.context.to(device),
        )


def padded_micro_batch(samples: PolicyBatch, rows: Tensor) -> MicroBatch:
    """The batch's own layout: row `i` is sample `i`, prompt left-padded to `P`, response
    right-padded to `R`; response token `t` is predicted at column `P - 1 + t` of its row."""
    batch_size, seq = len(samples), samples.prompt_length + samples.response_length
    device = samples.prompts.device
    real = torch.cat([samples.prompt_mask, torch.ones_like(samples.response_mask)], dim=1)
    row_starts = torch.arange(batch_size, device=device)[:, None] * seq
    first = samples.prompt_length - 1
    columns = first + torch.arange(samples.response_length, device=device)
    return MicroBatch(
        samples=samples,
        rows=rows,
        input_ids=samples.input_ids,
        position_ids=torch.arange(seq, device=device).expand(batch_size, seq),
        segment_ids=torch.where(real, 0, PADDING_SEGMENT),
        response_index=row_starts + columns[None, :],
        response_columns=slice(first, first + samples.response_length),
        routed_experts=samples.routed_experts,
    )


def pad_sequence(micro_batch: MicroBatch, multiple: int) -> MicroBatch:
    """`micro_batch` with every row padded at its end to a width `T'` that `multiple` divides (itself
    when it divides `T` already). Megatron's sequence parallelism splits the sequence dimension over the
    TP ranks and asserts it divides (`_split_along_first_dim` / `_reduce_scatter_along_first_dim` in
    megatron/core/tensor_parallel/mappings.py), so with it `multiple` is TP (megatron-core's own rule
    for SP alone, `get_padding` in megatron/core/models/multimodal/context_parallel.py; the 2 × CP
    factor there is context parallelism's).

    The new columns are padding (`PADDING_SEGMENT`): no sample's token attends to them, so every
    sample's outputs stay what they were. In the THD layout they are one more `cu_seqlens` sequence
    (they attend to themselves; nothing reads them), so the sequences still cover the row."""
    rows, width = micro_batch.input_ids.shape
    padded = -(-width // multiple) * multiple
    if padded == width:
        return micro_batch
    extra = padded - width

    def widen(tensor: Tensor, fill: int) -> Tensor:
        return torch.cat([tensor, tensor.new_full((rows, extra, *tensor.shape[2:]), fill)], dim=1)

    index = micro_batch.response_index
    cu_seqlens, max_seqlen = micro_batch.cu_seqlens, micro_batch.max_seqlen
    if cu_seqlens is not None:
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([padded])])
        max_seqlen = max(max_seqlen or 0, extra)
    return MicroBatch(
        samples=micro_batch.samples,
        rows=micro_batch.rows,
        input_ids=widen(micro_batch.input_ids, 0),
        position_ids=widen(micro_batch.position_ids, 0),
        segment_ids=widen(micro_batch.segment_ids, PADDING_SEGMENT),
        # Flat index row * T + column becomes row * T' + column.
        response_index=index // width * padded + index % width,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        response_columns=micro_batch.response_columns,  # columns added at the rows' end move no column
        routed_experts=None if micro_batch.routed_experts is None else widen(micro_batch.routed_experts, -1),
    )


def token_counts(batch: PolicyBatch) -> Tensor:
    """`[B, 2]` int64 real prompt tokens and response tokens up to the last counted one (a token that
    never counts and comes after every counted one never influences a counted log-prob)."""
    counted = batch.response_mask * torch.arange(1, batch.response_length + 1, device=batch.response_mask.device)
    return torch.stack([batch.prompt_mask.sum(dim=1), counted.amax(dim=1)], dim=1)


def packed_micro_batch(
    samples: PolicyBatch,
    rows: Tensor,
    row_sizes: list[int],
    *,
    row_length: int | None,
    num_rows: int | None,
    sample_multiple: int = 1,
) -> MicroBatch:
    """Rows of `samples`' real tokens (prompt, then response up to its last counted token), one
    after another: row `k` holds the next `row_sizes[k]` samples. Rows are padded at their end to
    `row_length` (None: to the longest row); `num_rows` adds rows of padding (pipeline stages exchange
    fixed shapes; None adds none). `sample_multiple`: each sample takes a multiple of it of columns, its
    real tokens then padding (`sample_spans`; context parallelism's 2 × CP chunks)."""
    counts = token_counts(samples).tolist()
    lengths = [prompt_len + response_len for prompt_len, response_len in counts]
    spans = sample_spans(lengths, sample_multiple)
    starts = [sum(row_sizes[:k]) for k in range(len(row_sizes))]
    row_tokens = [sum(spans[start : start + size]) for start, size in zip(starts, row_sizes)]
    width = max(row_tokens, default=0) if row_length is None else row_length
    if max(row_tokens, default=0) > width:
        raise ValueError(f"packed_micro_batch: {max(row_tokens)} tokens do not fit a row of {row_length}")
    total_rows = len(row_sizes) if num_rows is None else num_rows
    input_ids = samples.prompts.new_zeros(total_rows, width)
    position_ids = torch.zeros(total_rows, width, dtype=torch.long)
    segment_ids = torch.full((total_rows, width), PADDING_SEGMENT, dtype=torch.long)
    routed = samples.routed_experts
    routed_experts = None if routed is None else routed.new_full((total_rows, width, *routed.shape[2:]), -1)
    index = []
    for k, (start, size) in enumerate(zip(starts, row_sizes)):
        column = 0
        for i in range(start, start + size):
            prompt_len, response_len = counts[i]
            length, offset = lengths[i], k * width + column
            input_ids[k, column : column + length] = torch.cat(
                [samples.prompts[i, samples.prompt_length - prompt_len :], samples.responses[i, :response_len]]
            )
            position_ids[k, column : column + length] = torch.arange(length)
            segment_ids[k, column : column + length] = i
            if routed_experts is not None:  # the sample's real tokens are one run of the batch's columns
                first = samples.prompt_length - prompt_len
                routed_experts[k, column : column + length] = routed[i, first : first + length]
            # Flat index of the column before response token t; uncounted ones stay inside the sample.
            predicting = offset + prompt_len - 1 + torch.arange(samples.response_length)
            index.append(predicting.clamp(offset, max(offset, offset + length - 1)))
            column += spans[i]
    device = samples.prompts.device
    return MicroBatch(
        samples=samples,
        rows=rows,
        input_ids=input_ids,
        position_ids=position_ids.to(device),
        segment_ids=segment_ids.to(device),
        # A sample without tokens (no prompt, nothing counted) points inside the micro-batch all the same.
        response_index=torch.stack(index).clamp(max=total_rows * width - 1).to(device),
        routed_experts=None if routed_experts is None else routed_experts.to(device),
    )


def sample_spans(lengths: list[int], multiple: int) -> list[int]:
    """Columns each sample of `lengths` tokens takes in a packed row: its length rounded up to `multiple`."""
    return [-(-length // multiple) * multiple for length in lengths]


def cut_micro_batches(batch: PolicyBatch, cut: int | TokenBudget, *, fixed_shape: bool) -> list[MicroBatch]:
    """`batch` as micro-batches: `cut` samples each (padded rows; `cut` must divide `len(batch)`), or
    packed rows under a `TokenBudget`, rows no wider than the padded batch
    (`megarl.workers.packing.pack_rows`).

    `fixed_shape`: every micro-batch has the same `[r, T]` (megatron's pipeline schedule sends one
    shape between stages): packed micro-batches get full-width rows and as many as the budget allows.
    """
    if isinstance(cut, TokenBudget):
        lengths = token_counts(batch).sum(dim=1).tolist()
        row_width = min(batch.prompt_length + batch.response_length, cut.max_tokens)
        micro_batches = []
        for row_plan in pack_rows(lengths, cut, row_width):
            rows = torch.tensor([i for row in row_plan for i in row], dtype=torch.long)
            micro_batches.append(
                packed_micro_batch(
                    batch.select(rows),
                    rows,
                    [len(row) for row in row_plan],
                    row_length=row_width if fixed_shape else None,
                    num_rows=cut.max_tokens // row_width if fixed_shape else None,
                )
            )
        return micro_batches
    return [padded_micro_batch(batch.select(rows), rows) for rows in consecutive_rows(len(batch), cut)]


def consecutive_rows(batch_size: int, micro_batch_size: int) -> list[Tensor]:
    """`[micro_batch_size]` int64 row indices of each micro-batch of consecutive samples; ValueError
    unless `micro_batch_size` divides `batch_size`."""
    if micro_batch_size <= 0 or batch_size % micro_batch_size != 0:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} must divide the {batch_size} samples of this DP rank "
            f"({batch_size} % {micro_batch_size} != 0); choose a micro_batch_size that divides it"
        )
    return list(torch.arange(batch_size).split(micro_batch_size))
