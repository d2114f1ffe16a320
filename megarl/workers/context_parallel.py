"""Context parallelism (`*.parallel.context_parallel_size`): each THD micro-batch's tokens split over the
CP ranks in megatron's load-balanced layout, and the per-token outputs gathered back.

The layout (megatron-core's and Transformer Engine's; Megatron-LM's `get_batch_on_this_cp_rank` with
`tex.thd_get_partitioned_indices` for THD): every `cu_seqlens` sequence, its length a multiple of 2·CP,
is cut into 2·CP equal chunks, and CP rank `r` holds chunks `r` and `2·CP - 1 - r` of each sequence,
back to back in sequence order. Under causal attention a chunk's cost grows with its position, so
pairing an early chunk with a late one gives every rank the same work. What the model is given on rank
`r` (megatron-core 0.16.1, as `GPTModel.forward` takes it under CP):
- `input_ids`/`position_ids` `[1, t / CP]`: this rank's tokens only;
- `PackedSeqParams` with the *global* `cu_seqlens` and `max_seqlen` of the whole row: megatron's THD RoPE
  (megatron/core/models/common/embeddings/rope_utils.py, `_apply_rotary_pos_emb_thd`: lengths
  `cu_seqlens.diff() // cp_size`, frequencies of chunks `r` and `2·CP - 1 - r` per sequence by
  `_get_thd_freqs_on_this_cp_rank`; TE's fused kernel, `fused_apply_rotary_pos_emb_thd(..., cp_size,
  cp_rank)`, the same) and TE's CP attention (`AttnFuncWithCPAndKVP2P` in
  transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py, which megatron's
  `TEDotProductAttention` selects with `cp_group`, `cp_global_ranks`, `cp_comm_type`) read them so;
- the last stage returns this rank's columns, `[1, t / CP, ...]`.

Outputs. The losses are nonlinear in a sample's tokens (per-sequence means, ratios against old
log-probs that live with the batch), so megarl does not cut them per rank: the per-token scalars the losses
read (log-probs and entropy, values) are computed on each rank's columns, all-gathered over CP into the
whole row, and every CP rank computes the same whole loss from them (`megarl.workers.context_shard.ContextShard.gather`). The gather's
backward hands each rank the gradient of its own columns only (megatron's
`gather_from_sequence_parallel_region` with `tensor_parallel_output_grad=False`), so the gradients of
the CP ranks' parameters are partial sums that add up, over CP, to the whole sample's: megatron reduces
them over DP × CP (`ProcessGroups.grad_group`; its DDP averages there, and its schedule multiplies each
loss by the CP size to undo that part: `forward_step_calc_loss` in pipeline_parallel/schedules.py). The
logits themselves are never gathered: a long row's `[t, V]` is what CP exists to avoid.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.workers.context_shard import ContextShard
from megarl.workers.micro_batches import MicroBatch


def load_balanced_columns(offsets: list[int], cp_size: int, cp_rank: int) -> Tensor:
    """`[t / cp_size]` int64 row columns CP rank `cp_rank` holds of a THD row whose sequences start at
    `offsets` (`cu_seqlens`, each length a multiple of 2·`cp_size`): chunks `cp_rank` and
    `2·cp_size - 1 - cp_rank` of each sequence, in sequence order (module docstring)."""
    columns = []
    for start, end in zip(offsets, offsets[1:]):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"a THD sequence of {length} tokens cannot be cut into 2 × context_parallel_size = {2 * cp_size} "
                "equal chunks (megarl pads every sequence to a multiple of it: megarl.workers.thd)"
            )
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            columns.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    return torch.cat(columns) if columns else torch.zeros(0, dtype=torch.long)


def split_for_context_parallel(micro_batch: MicroBatch, group: dist.ProcessGroup) -> MicroBatch:
    """This CP rank's share of a THD `micro_batch` (`cu_seqlens` set, one row): its tokens in the
    load-balanced layout, the row's `cu_seqlens`, `max_seqlen`, samples and `response_index` as they were
    (the index reads the gathered row: `MicroBatch.response_outputs`)."""
    if micro_batch.cu_seqlens is None:
        raise ValueError("context parallelism splits THD micro-batches only (the Transformer Engine spec)")
    cp_size, cp_rank = group.size(), group.rank()
    offsets = micro_batch.cu_seqlens.tolist()
    columns = load_balanced_columns(offsets, cp_size, cp_rank).to(micro_batch.input_ids.device)
    every_rank = torch.cat([load_balanced_columns(offsets, cp_size, rank) for rank in range(cp_size)])
    row = micro_batch.input_ids[0]
    following = torch.cat([row[1:], row.new_zeros(1)])
    shard = ContextShard(
        group=group, columns=columns, targets=following[columns][None], order=every_rank.argsort().to(row.device)
    )
    return dataclasses.replace(
        micro_batch,
        input_ids=micro_batch.input_ids[:, columns],
        position_ids=micro_batch.position_ids[:, columns],
        segment_ids=micro_batch.segment_ids[:, columns],
        context=shard,
    )
