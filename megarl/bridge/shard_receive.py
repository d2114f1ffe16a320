"""Receive a weight sync as the trainer's own TP shards, each straight into its place in the full
HF tensors here.

Every trainer rank of DP replica 0 (every TP rank of every PP stage) sends *its own* shards of each
bucket of the plan straight to every receiver (`megarl.bridge.shard_send.ShardSender`), so nothing
is gathered on the trainer and each byte crosses the wire once per receiver. The sync group
(`sync_group.create_weight_sync_group`) is laid out as:

- group ranks `0 .. S-1`: the senders, S = train TP × train PP, `sender_rank(layout, pp_rank, tp_rank)`
  = pp_rank × train TP + tp_rank (group rank 0, stage 0's TP rank 0, hosts the store);
- group ranks `S ..`: the receivers, engine k's worker r at `receiver_rank(layout, k, r)`
  = S + k × rollout TP + r.

Wire format (`shard_schedule`, pure, computed identically on both sides from the `SyncPlan`): for
bucket b, each TP rank of the owning stage sends each receiver its *pieces* of the bucket's
parameters, in plan order, point-to-point with tag b. A piece is a block of consecutive rows of one
HF tensor, so the receiver receives it in place, no copy: a replicated parameter (from TP rank 0
only), a vocabulary shard without Megatron's padding rows, the gate or the up half of a gate/up
shard, the q, k or v part of a qkv shard (made contiguous by the sender: the one copy there). A
row-parallel shard (o_proj, down_proj) is a block of columns: in place at TP 1, else received
aside and copied into its columns (the one copy here). Nothing else is copied on either side.

    # vLLM worker (any receiver): the plan is pure, build it from the same (dims, layout, bucket size, dtype)
    group = create_weight_sync_group(host, port, receiver_rank(plan.layout, engine, worker), world_size, 60)
    model.reload_weights(weights_iterator=receive_shards(group, plan, device))

`receive_shards` yields `(hf_name, tensor)` per bucket, in plan order: views into a fresh flat
buffer laid out as `bucket.metadata` (the full HF tensors, whatever the rollout TP; fresh, so a
loader may keep them). Memory: one bucket, plus the column blocks of its row-parallel shards.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.bridge.convert import mapping_of
from megarl.bridge.plan import LayoutPair, PlannedBucket, PlannedParam, SyncPlan
from megarl.config.memory import VOCAB_DIVISIBLE_BY
from megarl.models.hf_config import ModelDims
from megarl.models.layout import REPLICATED, ROW, ROW_BLOCK_KINDS, VOCAB, padded_vocab_size, shard_pieces
from megarl.bridge.protocol import unpack


@dataclass(frozen=True)
class ShardPiece:
    """One block of one HF tensor that one TP rank sends (all or part of its shard of a parameter)."""

    param: PlannedParam
    """The Megatron parameter it is (part of) a shard of."""
    tp_rank: int
    """The train TP rank that holds (and sends) it."""
    hf_index: int
    """Which of `param.hf_names` it lands in."""
    shape: tuple[int, ...]
    """Its shape as sent (a qkv part: `[KV groups of the rank, rows per group, ...]`)."""
    start: int
    """First row (rows kinds) or column (row-parallel) of the HF tensor it fills."""
    stop: int
    """One past its last row / column."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def columns(self) -> bool:
        """A block of columns (a row-parallel shard), not of rows."""
        return self.param.kind == ROW


@dataclass(frozen=True)
class ShardMessage:
    """What one sender sends every receiver for one bucket: its pieces, one point-to-point send each."""

    sender: int
    """The sender's rank in the sync group (`sender_rank`)."""
    pieces: tuple[ShardPiece, ...]
    """Its pieces in send order (plan order, then HF tensor order)."""

    @property
    def numel(self) -> int:
        return sum(piece.numel for piece in self.pieces)


@dataclass(frozen=True)
class BucketShards:
    """One bucket of the plan as it travels: the owning stage's senders' messages."""

    bucket: PlannedBucket
    """The plan's bucket (its `metadata` lays out the assembled HF tensors)."""
    messages: tuple[ShardMessage, ...]
    """One per sender of the owning stage that holds anything of the bucket, in sender order."""

    @property
    def numel(self) -> int:
        """Elements of all its messages."""
        return sum(message.numel for message in self.messages)


def sender_rank(layout: LayoutPair, pp_rank: int, tp_rank: int) -> int:
    """Sync-group rank of the trainer rank (pp_rank, tp_rank) of DP replica 0."""
    return pp_rank * layout.train_tp + tp_rank


def receiver_rank(layout: LayoutPair, engine_index: int, worker_rank: int) -> int:
    """Sync-group rank of rollout engine `engine_index`'s TP worker `worker_rank`."""
    return layout.train_tp * layout.train_pp + engine_index * layout.rollout_tp + worker_rank


def shard_shape(param: PlannedParam, dims: ModelDims, tp_size: int, tp_rank: int, vocab_divisible_by: int) -> tuple:
    """TP rank `tp_rank`'s shard of `param` as sent: the Megatron shard, vocabulary padding rows cut.
    qkv / gate-up: `[rows of all HF tensors / tp, ...]`; row-parallel: `[out, in / tp]`;
    vocabulary: the rank's rows of the padded vocabulary that lie below `vocab_size`."""
    first = param.hf_shapes[0]
    if param.kind == REPLICATED:
        return first
    if param.kind == ROW:
        return (first[0], first[1] // tp_size)
    if param.kind == VOCAB:
        rows = vocab_rows(dims, vocab_divisible_by, tp_size, tp_rank)
        return (rows.stop - rows.start, *first[1:])
    return (sum(shape[0] for shape in param.hf_shapes) // tp_size, *first[1:])


def vocab_rows(dims: ModelDims, vocab_divisible_by: int, tp_size: int, tp_rank: int) -> slice:
    """The vocabulary rows TP rank `tp_rank` holds, padding rows past the vocabulary cut (maybe none)."""
    per_rank = padded_vocab_size(dims.vocab_size, vocab_divisible_by, tp_size) // tp_size
    start = min(tp_rank * per_rank, dims.vocab_size)
    return slice(start, min(start + per_rank, dims.vocab_size))


def rank_pieces(param: PlannedParam, dims: ModelDims, tp_size: int, tp_rank: int,
                vocab_divisible_by: int) -> list[ShardPiece]:
    """The pieces TP rank `tp_rank` sends of `param` (none of a replicated one but on TP rank 0)."""
    if param.kind == REPLICATED and tp_rank > 0:
        return []
    shape = shard_shape(param, dims, tp_size, tp_rank, vocab_divisible_by)
    if param.kind in ROW_BLOCK_KINDS:
        meta = torch.empty(shape, device="meta")  # shard_pieces needs only the shape
        return [ShardPiece(param, tp_rank, index, tuple(piece.shape), rows.start, rows.stop)
                for index, (piece, rows) in enumerate(shard_pieces(mapping_of(param), meta, dims, tp_rank))]
    if param.kind == ROW:
        return [ShardPiece(param, tp_rank, 0, shape, tp_rank * shape[1], (tp_rank + 1) * shape[1])]
    if param.kind == VOCAB:
        start = vocab_rows(dims, vocab_divisible_by, tp_size, tp_rank).start
        return [ShardPiece(param, tp_rank, 0, shape, start, start + shape[0])] if shape[0] else []
    return [ShardPiece(param, tp_rank, 0, shape, 0, shape[0])]


@functools.lru_cache(maxsize=16)
def shard_schedule(plan: SyncPlan, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> tuple[BucketShards, ...]:
    """Every bucket's messages, in plan order (cached per plan). `vocab_divisible_by`: Megatron's
    `make_vocab_size_divisible_by` of the trainer's model (where its vocabulary shards split)."""
    layout, dims = plan.layout, plan.dims
    schedule = []
    for bucket in plan.buckets:
        messages = []
        for tp_rank in range(layout.train_tp):
            pieces = [piece for param in bucket.params
                      for piece in rank_pieces(param, dims, layout.train_tp, tp_rank, vocab_divisible_by)]
            if pieces:
                messages.append(ShardMessage(sender_rank(layout, bucket.pp_rank, tp_rank), tuple(pieces)))
        schedule.append(BucketShards(bucket, tuple(messages)))
    return tuple(schedule)


Receive = Callable[[torch.Tensor, int], object]
"""`(destination, sender's group rank)` → a handle whose `wait()` returns once `destination` holds
the sender's next piece (`ProcessGroup.recv`'s work)."""


def receive_bucket(shards: BucketShards, receive: Receive, device: torch.device) -> torch.Tensor:
    """One bucket's HF tensors in a fresh flat buffer `[bucket.metadata.numel]` laid out as the
    metadata: every piece received in place, a partial column block aside and then copied."""
    metadata = shards.bucket.metadata
    flat = torch.empty(metadata.numel, dtype=metadata.dtype, device=device)
    views = dict(unpack(flat, metadata))
    pending, aside = [], []
    for message in shards.messages:
        for piece in message.pieces:
            target = views[piece.param.hf_names[piece.hf_index]]
            if not piece.columns:
                destination = target[piece.start : piece.stop].view(piece.shape)
            elif piece.stop - piece.start == target.shape[1]:  # the whole tensor (TP 1)
                destination = target
            else:
                destination = torch.empty(piece.shape, dtype=flat.dtype, device=device)
                aside.append((destination, target[:, piece.start : piece.stop]))
            pending.append(receive(destination, message.sender))
    for work in pending:
        work.wait()
    for received, columns in aside:
        columns.copy_(received)
    return flat


def receive_shards(
    group: dist.ProcessGroup, plan: SyncPlan, device: torch.device, *, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: per bucket in plan order, receive every sender's pieces in place and yield the
    HF tensors as `(hf_name, view)` of the bucket's fresh flat buffer. Lazy: the next bucket is
    received when the consumer asks for its first tensor."""
    for tag, shards in enumerate(shard_schedule(plan, vocab_divisible_by)):
        flat = receive_bucket(shards, lambda destination, sender: group.recv([destination], sender, tag), device)
        yield from unpack(flat, shards.bucket.metadata)
