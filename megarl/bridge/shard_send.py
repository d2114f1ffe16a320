"""The trainer side of a shard sync: every rank of DP replica 0 sends its own TP shards straight to
every receiver, which assembles the HF tensors (`megarl.workers.rollout.shard_receive`, where the
sync group's layout and the wire format are described). No trainer-world communication: no TP
gather, no move between pipeline stages.

    # every trainer rank; DP replica 0 joins the sync group at its sender rank (rank 0 hosts the store)
    group = None
    if groups.dp_rank == 0:
        rank = sender_rank(plan.layout, groups.pp_rank, groups.tp_rank)
        group = create_weight_sync_group(host, port, rank, senders + receivers, 60)
    sender = ShardSender(plan, actor.named_parameters_for_sync, groups, group)
    stats = sender.send()      # the receivers run receive_shards(group, plan, device) meanwhile

Per bucket of its stage, a rank packs its shards of the bucket's parameters (plan order, cast to the
plan's dtype, vocabulary padding rows cut) into one flat buffer and sends it to each receiver with
non-blocking point-to-point sends; it packs the next bucket while those are in flight, so it holds
at most two flat buffers (`SyncStats.peak_buffer_bytes`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megarl.bridge.collect import BufferMeter, local_params_by_plan_name
from megarl.bridge.plan import SyncPlan
from megarl.bridge.sync import NamedParameters, SyncStats
from megarl.config.memory import VOCAB_DIVISIBLE_BY
from megarl.models.layout import VOCAB, padded_vocab_size
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.rollout.shard_receive import ShardMessage, sender_rank, shard_schedule


def pack_message(
    plan: SyncPlan, message: ShardMessage, local: dict[str, torch.Tensor], flat: torch.Tensor, vocab_divisible_by: int
) -> None:
    """This rank's shards of `message` (`local`: plan Megatron name → its shard) into `flat
    [message.numel]`, cast to `flat`'s dtype. Raises ValueError when a shard's shape is not the
    schedule's (a model padded with another `vocab_divisible_by`, or another layout than the plan's)."""
    for slot in message.slots:
        param = slot.param
        if param.megatron_name not in local:
            raise KeyError(f"shard sync: this rank has no parameter {param.megatron_name}, which the plan sends from it")
        shard = local[param.megatron_name].detach()
        if param.kind == VOCAB:
            tp = plan.layout.train_tp
            padded_rows = padded_vocab_size(plan.dims.vocab_size, vocab_divisible_by, tp) // tp
            if shard.shape[0] != padded_rows:
                raise ValueError(
                    f"shard sync: {param.megatron_name} has {shard.shape[0]} rows on this TP rank, not the "
                    f"{padded_rows} of a vocabulary padded to a multiple of vocab_divisible_by={vocab_divisible_by} "
                    f"× TP {tp}: pass the model's make_vocab_size_divisible_by as vocab_divisible_by"
                )
            shard = shard[: slot.shape[0]]  # the padding rows are not sent
        if tuple(shard.shape) != slot.shape:
            raise ValueError(
                f"shard sync: {param.megatron_name} is {list(shard.shape)} on this rank, but the plan for "
                f"{plan.layout} expects a TP shard of {list(slot.shape)}"
            )
        flat[slot.offset : slot.offset + slot.numel].view(slot.shape).copy_(shard)


class ShardSender:
    """The trainer side of the shard sync for one plan (built once per layout pair, reused every step)."""

    def __init__(
        self,
        plan: SyncPlan,
        named_parameters: NamedParameters,
        groups: ProcessGroups,
        group: dist.ProcessGroup | None,
        *,
        vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
    ):
        """`group`: the sync group on DP replica 0's ranks (this rank at `sender_rank`), None on the
        other DP replicas (they send nothing). `vocab_divisible_by`: the model's Megatron
        `make_vocab_size_divisible_by`."""
        if (group is None) != (groups.dp_rank != 0):
            raise ValueError(
                f"shard sync: DP rank {groups.dp_rank} was given {'no' if group is None else 'a'} sync group; "
                "every rank of DP replica 0, and only those, joins it"
            )
        self.plan, self.named_parameters, self.group = plan, named_parameters, group
        self.vocab_divisible_by = vocab_divisible_by
        self.receivers: range = range(0)
        self.messages: list[tuple[int, ShardMessage]] = []  # (tag = bucket index, this rank's message), plan order
        if group is None:
            return
        me = sender_rank(plan.layout, groups.pp_rank, groups.tp_rank)
        if group.rank() != me:
            raise ValueError(f"shard sync: this rank (PP {groups.pp_rank}, TP {groups.tp_rank}) must be sync-group "
                             f"rank {me}, not {group.rank()}")
        self.receivers = range(plan.layout.train_tp * plan.layout.train_pp, group.size())
        self.messages = [
            (tag, message)
            for tag, shards in enumerate(shard_schedule(plan, vocab_divisible_by))
            for message in shards.messages
            if message.sender == me
        ]

    def send(self) -> SyncStats:
        """Send every message of this rank to every receiver; returns when all are delivered.
        Involves this rank and the receivers only (call it on every trainer rank: the other DP
        replicas return at once). `bytes_sent` counts each message once, like a broadcast."""
        start = time.perf_counter()
        meter = BufferMeter()
        if not self.messages:
            return SyncStats(time.perf_counter() - start, 0, 0, 0)
        local = local_params_by_plan_name(self.plan, self.named_parameters())
        dtype = self.plan.buckets[0].metadata.dtype
        largest = max(message.numel for _, message in self.messages)
        device = next(iter(local.values())).device
        buffers: list[torch.Tensor] = []
        in_flight: list[list[dist.Work]] = [[], []]
        sent = 0
        with torch.no_grad():
            for i, (tag, message) in enumerate(self.messages):
                if len(buffers) <= i % 2:
                    buffers.append(torch.empty(largest, dtype=dtype, device=device))
                    meter.hold(buffers[-1].nbytes)
                for work in in_flight[i % 2]:  # this buffer's previous message must be delivered first
                    work.wait()
                flat = buffers[i % 2][: message.numel]
                pack_message(self.plan, message, local, flat, self.vocab_divisible_by)
                in_flight[i % 2] = [self.group.send([flat], receiver, tag) for receiver in self.receivers]
                sent += flat.nbytes
            for works in in_flight:
                for work in works:
                    work.wait()
        return SyncStats(time.perf_counter() - start, sent, len(self.messages), meter.peak)
