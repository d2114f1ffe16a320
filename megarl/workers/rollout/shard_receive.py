"""Receive a weight sync as the trainer's own TP shards and assemble the full HF tensors here.

Every trainer rank of DP replica 0 (every TP rank of every PP stage) sends *its own* shards of each
bucket of the plan straight to every receiver (`megarl.bridge.shard_send.ShardSender`), so nothing
is gathered on the trainer and each byte crosses the wire once per receiver. The sync group
(`sync_group.create_weight_sync_group`) is laid out as:

- group ranks `0 .. S-1`: the senders, S = train TP × train PP, `sender_rank(layout, pp_rank, tp_rank)`
  = pp_rank × train TP + tp_rank (group rank 0, stage 0's TP rank 0, hosts the store);
- group ranks `S ..`: the receivers, engine k's worker r at `receiver_rank(layout, k, r)`
  = S + k × rollout TP + r.

Wire format (`shard_schedule`, pure, computed identically on both sides from the `SyncPlan`): for
bucket b, each TP rank of the owning stage sends each receiver one flat buffer of the plan's dtype
holding its shards of the bucket's parameters in plan order, back to back, point-to-point with
tag b (one message per bucket, sender and receiver; a sender with nothing in a bucket sends
nothing). Replicated parameters (norms) travel in TP rank 0's buffer only; vocabulary shards
without Megatron's padding rows (a shard entirely past the vocabulary is empty).

    # vLLM worker (any receiver): the plan is pure, build it from the same (dims, layout, bucket size, dtype)
    group = create_weight_sync_group(host, port, receiver_rank(plan.layout, engine, worker), world_size, 60)
    model.reload_weights(weights_iterator=receive_shards(group, plan, device))

`receive_shards` yields `(hf_name, tensor)` per bucket, in plan order: views into a fresh flat
buffer laid out as `bucket.metadata` (the full HF tensors, whatever the rollout TP). Memory: one
bucket of received shards (one buffer, reused for every bucket) plus the bucket being handed out.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.bridge.convert import to_hf_into
from megarl.bridge.plan import LayoutPair, PlannedBucket, PlannedParam, SyncPlan
from megarl.config.memory import VOCAB_DIVISIBLE_BY
from megarl.models.hf_config import ModelDims
from megarl.models.layout import REPLICATED, ROW, VOCAB, padded_vocab_size
from megarl.workers.rollout.weight_sync_protocol import unpack


@dataclass(frozen=True)
class ShardSlot:
    """Where one TP shard of one planned parameter lies in a sender's flat buffer."""

    param: PlannedParam
    """The Megatron parameter it is a shard of."""
    tp_rank: int
    """The train TP rank that holds (and sends) it."""
    offset: int
    """First element in the sender's flat buffer (elements, not bytes)."""
    shape: tuple[int, ...]
    """The shard's shape as sent (a vocabulary shard without its padding rows)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardMessage:
    """What one sender sends every receiver for one bucket: one flat buffer `[numel]`."""

    sender: int
    """The sender's rank in the sync group (`sender_rank`)."""
    slots: tuple[ShardSlot, ...]
    """Its shards in plan order, packed back to back from offset 0."""

    @property
    def numel(self) -> int:
        last = self.slots[-1]
        return last.offset + last.numel


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
        per_rank = padded_vocab_size(dims.vocab_size, vocab_divisible_by, tp_size) // tp_size
        return (min(per_rank, max(0, dims.vocab_size - tp_rank * per_rank)), *first[1:])
    return (sum(shape[0] for shape in param.hf_shapes) // tp_size, *first[1:])


@functools.lru_cache(maxsize=16)
def shard_schedule(plan: SyncPlan, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> tuple[BucketShards, ...]:
    """Every bucket's messages, in plan order (cached per plan). `vocab_divisible_by`: Megatron's
    `make_vocab_size_divisible_by` of the trainer's model (where its vocabulary shards split)."""
    layout, dims = plan.layout, plan.dims
    schedule = []
    for bucket in plan.buckets:
        messages = []
        for tp_rank in range(layout.train_tp):
            slots, offset = [], 0
            for param in bucket.params:
                if tp_rank > 0 and not param.needs_tp_gather:
                    continue
                shape = shard_shape(param, dims, layout.train_tp, tp_rank, vocab_divisible_by)
                slot = ShardSlot(param, tp_rank, offset, tuple(shape))
                if slot.numel:
                    slots.append(slot)
                    offset += slot.numel
            if slots:
                messages.append(ShardMessage(sender_rank(layout, bucket.pp_rank, tp_rank), tuple(slots)))
        schedule.append(BucketShards(bucket, tuple(messages)))
    return tuple(schedule)


def assemble_bucket(shards: BucketShards, buffers: Sequence[torch.Tensor], dims: ModelDims, flat: torch.Tensor) -> None:
    """The bucket's HF tensors into `flat [bucket.metadata.numel]` (laid out as the metadata) from
    each message's received buffer (`buffers[i]`: `[messages[i].numel]`)."""
    by_param: dict[str, list[torch.Tensor]] = {}
    for message, buffer in zip(shards.messages, buffers):
        for slot in message.slots:
            view = buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)
            by_param.setdefault(slot.param.megatron_name, []).append(view)
    views = {name: tensor for name, tensor in unpack(flat, shards.bucket.metadata)}
    for param in shards.bucket.params:
        # A vocabulary shard entirely past the vocabulary was not sent: the others merge alone.
        to_hf_into(param, by_param[param.megatron_name], dims, [views[name] for name in param.hf_names])


def receive_shards(
    group: dist.ProcessGroup, plan: SyncPlan, device: torch.device, *, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: per bucket in plan order, receive every sender's message, assemble the HF
    tensors and yield them as `(hf_name, view)` of a fresh flat buffer. Lazy: the next bucket is
    received when the consumer asks for its first tensor."""
    schedule = shard_schedule(plan, vocab_divisible_by)
    dtype = plan.buckets[0].metadata.dtype
    received = torch.empty(max(shards.numel for shards in schedule), dtype=dtype, device=device)
    for tag, shards in enumerate(schedule):
        buffers, works, start = [], [], 0
        for message in shards.messages:
            buffer = received[start : start + message.numel]
            start += message.numel
            buffers.append(buffer)
            works.append(group.recv([buffer], message.sender, tag))
        for work in works:
            work.wait()
        metadata = shards.bucket.metadata
        flat = torch.empty(metadata.numel, dtype=metadata.dtype, device=device)
        assemble_bucket(shards, buffers, plan.dims, flat)
        yield from unpack(flat, metadata)
