"""The trainer side of a shard sync: every rank of DP replica 0 sends its own TP shards straight to
every receiver, which receives each piece in place in the HF tensors
(`megarl.bridge.shard_receive`, where the sync group's layout and the wire format are
described). No trainer-world communication: no TP gather, no move between pipeline stages.

    # every trainer rank; DP replica 0 joins the sync group at its sender rank (rank 0 hosts the store)
    group = None
    if groups.dp_rank == 0:
        rank = sender_rank(plan.layout, groups.pp_rank, groups.tp_rank)
        group = create_weight_sync_group(host, port, rank, senders + receivers, 60)
    sender = ShardSender(plan, actor.named_parameters_for_sync, groups, group)
    stats = sender.send()      # the receivers run receive_shards(group, plan, device) meanwhile

Per bucket of its stage, a rank sends each piece of its shards as it is, a view of the live
parameter, with non-blocking point-to-point sends; only a qkv part (strided in the shard) or a
parameter in another dtype than the plan's is copied first. At most two buckets' sends are in flight
(`SyncStats.peak_buffer_bytes`: the copies alive at once).
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from megarl.bridge.collect import BufferMeter, local_params_by_plan_name
from megarl.bridge.convert import mapping_of
from megarl.bridge.plan import SyncPlan
from megarl.bridge.sync import NamedParameters, SyncStats
from megarl.config.memory import VOCAB_DIVISIBLE_BY
from megarl.models.layout import ROW_BLOCK_KINDS, VOCAB, padded_vocab_size, shard_pieces
from megarl.parallel.distributed import ProcessGroups
from megarl.bridge.shard_receive import ShardMessage, ShardPiece, sender_rank, shard_schedule

IN_FLIGHT = 2
"""Buckets whose sends may be outstanding at once (each holds its copies until delivered)."""


def piece_tensor(plan: SyncPlan, piece: ShardPiece, shard: torch.Tensor,
                 vocab_divisible_by: int) -> tuple[torch.Tensor, bool]:
    """`piece` of this rank's `shard` of its parameter, contiguous and in the plan's dtype, and whether
    it is a copy: it is a view of the shard unless strided (a qkv part) or in another dtype. Raises
    ValueError when the shard is not the one the plan expects (another layout, or a vocabulary padded
    otherwise)."""
    param, dims = piece.param, plan.dims
    if param.kind == VOCAB:
        tp = plan.layout.train_tp
        padded_rows = padded_vocab_size(dims.vocab_size, vocab_divisible_by, tp) // tp
        if shard.shape[0] != padded_rows:
            raise ValueError(
                f"shard sync: {param.megatron_name} has {shard.shape[0]} rows on this TP rank, not the "
                f"{padded_rows} of a vocabulary padded to a multiple of vocab_divisible_by={vocab_divisible_by} "
                f"× TP {tp}: pass the model's make_vocab_size_divisible_by as vocab_divisible_by"
            )
        tensor = shard[: piece.stop - piece.start]  # the padding rows are not sent
    elif param.kind in ROW_BLOCK_KINDS:
        tensor = shard_pieces(mapping_of(param), shard, dims, piece.tp_rank)[piece.hf_index][0]
    else:
        tensor = shard
    if tuple(tensor.shape) != piece.shape:
        raise ValueError(
            f"shard sync: {param.megatron_name} gives a piece of {list(tensor.shape)} on this rank, but the plan "
            f"for {plan.layout} expects {list(piece.shape)} (shard {list(shard.shape)})"
        )
    sent = tensor.to(plan.buckets[0].metadata.dtype).contiguous()
    return sent, sent is not tensor


def message_tensors(plan: SyncPlan, message: ShardMessage, local: dict[str, torch.Tensor],
                    vocab_divisible_by: int) -> list[tuple[torch.Tensor, bool]]:
    """This rank's tensors of `message` in send order, each with whether it is a copy (`local`: plan
    Megatron name → its shard)."""
    tensors = []
    for piece in message.pieces:
        name = piece.param.megatron_name
        if name not in local:
            raise KeyError(f"shard sync: this rank has no parameter {name}, which the plan sends from it")
        tensors.append(piece_tensor(plan, piece, local[name].detach(), vocab_divisible_by))
    return tensors


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
        in_flight: deque[tuple[list[dist.Work], int]] = deque()
        sent = 0
        with torch.no_grad():
            for tag, message in self.messages:
                if len(in_flight) == IN_FLIGHT:
                    _delivered(*in_flight.popleft(), meter)
                tensors = message_tensors(self.plan, message, local, self.vocab_divisible_by)
                copies = sum(t.nbytes for t, copied in tensors if copied)
                meter.hold(copies)
                works = [self.group.send([t], receiver, tag) for t, _ in tensors for receiver in self.receivers]
                in_flight.append((works, copies))
                sent += sum(t.nbytes for t, _ in tensors)
            while in_flight:
                _delivered(*in_flight.popleft(), meter)
        return SyncStats(time.perf_counter() - start, sent, len(self.messages), meter.peak)


def _delivered(works: list[dist.Work], copies: int, meter: BufferMeter) -> None:
    for work in works:
        work.wait()
    meter.release(copies)

