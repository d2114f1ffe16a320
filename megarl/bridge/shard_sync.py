"""The shard sync, both halves: every trainer rank of DP replica 0 (and, for the experts, of the
first expert-DP replica: each EP rank sends the experts it holds) sends each vLLM worker exactly
the pieces of its own shards that the worker's TP shard needs, and the worker assembles its
per-rank tensors (vLLM's names and shapes) from them, so no full tensor is built anywhere and
nothing goes through trainer rank 0. Both sides replay the planner's schedule
(`schedule.build_schedule`: who sends which block of which HF tensor to whom), so no metadata travels.

The sync group (`sync_group.create_weight_sync_group`) is laid out as:

- group ranks `0 .. S-1`: the senders, S = PP × max(TP, expert TP × EP) (`LayoutPair.senders`),
  `schedule.sender_rank(layout, pp, i)` = pp × S/PP + i for the stage's rank i: the first ranks of a
  stage hold DP replica 0's dense shards and the first expert-DP replica's experts (group rank 0,
  stage 0's first rank, hosts the store);
- group ranks `S ..`: the receivers, engine k's worker r at `plan.receiver_rank(layout, k, r)`.

Bucket b travels with tag b, one point-to-point send per piece. A piece is a block of rows of one
HF tensor, received in place into the worker's tensor; a block of columns (row-parallel layers)
is received in place when it is all the worker's columns, else aside and copied into them. The
sender sends views of its live parameters where it can; it copies a qkv part (strided in the
shard), a partial block of columns, or a parameter in another dtype than the plan's.

    # every trainer rank; DP replica 0 joins the sync group at its sender rank (rank 0 hosts the store)
    sender = ShardSender(plan, actor.named_parameters_for_sync, groups, group)   # group: None off DP 0
    stats = sender.send()
    # each vLLM worker r of engine k, meanwhile (the plan is pure: built from the same arguments):
    load(receive_rank_shards(group, plan, r, device))   # (vLLM name, per-rank tensor) pairs

Memory: a sender holds at most `IN_FLIGHT` buckets' copies; a receiver one bucket of its own
tensors (a fresh buffer per bucket, so a loader may keep them).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.bridge.collect import BufferMeter, local_params_by_plan_name, sync_rank
from megarl.bridge.convert import mapping_of
from megarl.bridge.plan import SyncPlan
from megarl.bridge.protocol import unpack
from megarl.bridge.schedule import BucketSchedule, Piece, SyncSchedule, build_schedule, receiver_rank
from megarl.bridge.sync import NamedParameters, SyncStats
from megarl.models.hf_config import ModelDims
from megarl.models.layout import ROW_BLOCK_KINDS, VOCAB, VOCAB_DIVISIBLE_BY, shard_pieces
from megarl.parallel.distributed import ProcessGroups

IN_FLIGHT = 2
"""Buckets whose sends may be outstanding at once (each holds its copies until delivered)."""


# --- sender ------------------------------------------------------------------------------------


def shard_block(piece: Piece, shard: torch.Tensor, dims: ModelDims) -> torch.Tensor:
    """The sender's block of the piece's HF tensor within its `shard` of the parameter, indexed
    like `piece.source` (rows; row-parallel: columns). A qkv part is made contiguous (a copy)."""
    param = piece.param
    if param.kind in ROW_BLOCK_KINDS:
        part = shard_pieces(mapping_of(param), shard, dims, piece.tp_rank)[piece.hf_index][0]
        return part.contiguous().reshape(-1, *shard.shape[1:])
    return shard


def piece_tensor(schedule: SyncSchedule, piece: Piece, block: torch.Tensor) -> torch.Tensor:
    """`piece` cut from the sender's `block` (`shard_block`), contiguous and in the plan's dtype.
    Raises ValueError when the block does not hold it (the shard is not the one the plan expects)."""
    stop = piece.source + piece.stop - piece.start
    tensor = block[:, piece.source : stop] if piece.columns else block[piece.source : stop]
    if tuple(tensor.shape) != piece.shape:
        raise ValueError(
            f"shard sync: {piece.param.megatron_name} gives a piece of {list(tensor.shape)} on TP rank "
            f"{piece.tp_rank}, but the schedule for {schedule.plan.layout} expects {list(piece.shape)} "
            f"(its block {list(block.shape)}; for the vocabulary pass the model's make_vocab_size_divisible_by)"
        )
    return tensor.to(schedule.plan.dtype).contiguous()


class ShardSender:
    """The trainer side of the shard sync for one plan (built once per layout, reused every step)."""

    def __init__(
        self,
        plan: SyncPlan,
        named_parameters: NamedParameters,
        groups: ProcessGroups,
        group: dist.ProcessGroup | None,
        *,
        vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
    ):
        """`group`: the sync group on the sending ranks (this rank at `collect.sync_rank`: DP replica
        0's and the first expert-DP replica's), None on the others (they send nothing).
        `vocab_divisible_by`: the model's Megatron `make_vocab_size_divisible_by`."""
        schedule = build_schedule(plan, vocab_divisible_by)
        layout = schedule.plan.layout
        me = sync_rank(layout, groups)
        if (group is None) != (me is None):
            raise ValueError(
                f"shard sync: the rank at DP {groups.dp_rank} / expert-DP {groups.expert_dp_rank} was given "
                f"{'no' if group is None else 'a'} sync group; every rank of DP replica 0 and of the first "
                "expert-DP replica, and only those, joins it"
            )
        self.schedule, self.named_parameters, self.groups, self.group = schedule, named_parameters, groups, group
        self.engines = 0
        self.pieces: list[tuple[int, Piece]] = []  # (tag, piece) of this rank, send order
        if group is None:
            return
        if group.rank() != me:
            raise ValueError(
                f"shard sync: this rank (PP {groups.pp_rank}, TP {groups.tp_rank}, EP {groups.ep_rank}) must be "
                f"sync-group rank {me}, not {group.rank()}"
            )
        receivers = group.size() - layout.senders
        if receivers <= 0 or receivers % layout.rollout_tp:
            raise ValueError(
                f"shard sync: {receivers} receiving ranks in the sync group are not whole engines of "
                f"rollout TP {layout.rollout_tp}"
            )
        self.engines = receivers // layout.rollout_tp
        self.pieces = schedule.sent_by(me)

    def send(self) -> SyncStats:
        """Send every piece of this rank to its worker of every engine; returns when all are
        delivered. Involves this rank and its receivers only (call it on every trainer rank: the
        other DP replicas return at once). `bytes_sent`: every byte put on the wire."""
        start = time.perf_counter()
        meter = BufferMeter()
        if not self.pieces:
            return SyncStats(time.perf_counter() - start, 0, 0, 0)
        local = local_params_by_plan_name(self.schedule.plan, self.named_parameters(), self.groups)
        in_flight: deque[tuple[list[dist.Work], int]] = deque()
        sent = 0
        with torch.no_grad():
            for tag, pieces in _by_tag(self.pieces):
                if len(in_flight) == IN_FLIGHT:
                    _delivered(*in_flight.popleft(), meter)
                works, copies = [], 0
                for piece, tensor in piece_tensors(self.schedule, pieces, local):
                    if not shares_storage(tensor, local[piece.param.megatron_name]):
                        copies += tensor.nbytes
                    works += [
                        self.group.send([tensor], receiver_rank(self.schedule.plan.layout, k, piece.worker), tag)
                        for k in range(self.engines)
                    ]
                    sent += tensor.nbytes * self.engines
                meter.hold(copies)
                in_flight.append((works, copies))
            while in_flight:
                _delivered(*in_flight.popleft(), meter)
        return SyncStats(time.perf_counter() - start, sent, len({tag for tag, _ in self.pieces}), meter.peak)


def piece_tensors(
    schedule: SyncSchedule, pieces: list[Piece], local: dict[str, torch.Tensor]
) -> Iterator[tuple[Piece, torch.Tensor]]:
    """Each of this rank's `pieces` with its tensor (`piece_tensor`), the blocks (one qkv part copy
    each) shared by the pieces cut from them; `local`: this rank's parameters by plan name."""
    blocks: dict[tuple[str, int], torch.Tensor] = {}
    for piece in pieces:
        name = piece.param.megatron_name
        if name not in local:
            raise KeyError(f"shard sync: this rank has no parameter {name}, which the schedule sends from it")
        key = (name, piece.hf_index)
        if key not in blocks:
            blocks[key] = shard_block(piece, local[name].detach(), schedule.plan.dims)
        yield piece, piece_tensor(schedule, piece, blocks[key])


def shares_storage(tensor: torch.Tensor, parameter: torch.Tensor) -> bool:
    """Whether `tensor` is a view of the live `parameter` (sent as it is), not a copy."""
    return tensor.untyped_storage().data_ptr() == parameter.untyped_storage().data_ptr()


def _by_tag(pieces: list[tuple[int, Piece]]) -> Iterator[tuple[int, list[Piece]]]:
    current, group = None, []
    for tag, piece in pieces:
        if tag != current and group:
            yield current, group
            group = []
        current = tag
        group.append(piece)
    if group:
        yield current, group


def _delivered(works: list[dist.Work], copies: int, meter: BufferMeter) -> None:
    for work in works:
        work.wait()
    meter.release(copies)


# --- receiver ----------------------------------------------------------------------------------


Receive = Callable[[torch.Tensor, int], object]
"""`(destination, sender's group rank)` → a handle whose `wait()` returns once `destination` holds
the sender's next piece (`ProcessGroup.recv`'s work)."""


@dataclass
class Inbox:
    """Where one worker's pieces of one bucket land: a fresh flat buffer laid out as
    `bucket.received[worker]` (`bucket_inbox`)."""

    flat: torch.Tensor
    """The worker's tensors of the bucket, `[numel]`: complete once every destination is filled and
    `finish()` has run."""
    destinations: list[tuple[Piece, torch.Tensor]]
    """Each of the worker's pieces, in schedule order, with the tensor to receive it into."""
    aside: list[tuple[torch.Tensor, torch.Tensor]]
    """(received, columns): partial column blocks received aside, copied in by `finish`."""

    def finish(self) -> torch.Tensor:
        """Once every destination holds its piece: copy the aside blocks in; the flat buffer."""
        for received, columns in self.aside:
            columns.copy_(received)
        return self.flat


def bucket_inbox(bucket: BucketSchedule, worker: int, device: torch.device) -> Inbox:
    """The destinations of worker `worker`'s pieces of one bucket: rows in place in a fresh flat
    buffer, a column block in place when it is all the worker's columns, else aside; the
    vocabulary padding rows zeroed (vLLM's loader leaves them zero)."""
    metadata = bucket.received[worker]
    flat = torch.empty(metadata.numel, dtype=metadata.dtype, device=device)
    views = [view for _, view in unpack(flat, metadata)]
    held = bucket.held[worker]
    by_param = dict(zip((param.megatron_name for param in held), views))
    destinations, aside = [], []
    for piece in bucket.pieces:
        if piece.worker != worker:
            continue
        target = by_param[piece.param.megatron_name]
        width = piece.stop - piece.start
        if not piece.columns:
            destination = target[piece.target : piece.target + width].view(piece.shape)
        elif width == target.shape[1]:  # all the worker's columns
            destination = target
        else:
            destination = torch.empty(piece.shape, dtype=flat.dtype, device=device)
            aside.append((destination, target[:, piece.target : piece.target + width]))
        destinations.append((piece, destination))
    for param, view in zip(held, views):
        if param.kind == VOCAB:
            filled = max(
                (p.target + p.stop - p.start for p in bucket.pieces if p.worker == worker and p.param is param),
                default=0,
            )
            view[filled:].zero_()
    return Inbox(flat, destinations, aside)


def receive_bucket(bucket: BucketSchedule, worker: int, receive: Receive, device: torch.device) -> torch.Tensor:
    """Worker `worker`'s tensors of one bucket in a fresh flat buffer laid out as
    `bucket.received[worker]`, every piece received into its `bucket_inbox` destination."""
    inbox = bucket_inbox(bucket, worker, device)
    pending = [receive(destination, piece.sender) for piece, destination in inbox.destinations]
    for work in pending:
        work.wait()
    return inbox.finish()


def receive_rank_shards(
    group: dist.ProcessGroup,
    plan: SyncPlan,
    worker: int,
    device: torch.device,
    *,
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side (vLLM TP rank `worker`): per bucket in plan order, receive this worker's pieces
    in place and yield its per-rank tensors as `(vLLM name, view)` of the bucket's fresh flat
    buffer. Lazy: the next bucket is received when the consumer asks for its first tensor."""
    schedule = build_schedule(plan, vocab_divisible_by)
    for tag, bucket in enumerate(schedule.buckets):
        if not bucket.held[worker]:  # only experts that vLLM expert parallelism places on other workers
            continue
        flat = receive_bucket(
            bucket, worker, lambda destination, sender, tag=tag: group.recv([destination], sender, tag), device
        )
        yield from unpack(flat, bucket.received[worker])


def rank_tensors_as_hf(
    plan: SyncPlan, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A rollout TP 1 worker's tensors (`receive_rank_shards`) as the full HF tensors they are
    (views): qkv_proj / gate_up_proj split into q, k, v / gate, up, the vocabulary padding cut (what
    an HF engine loads)."""
    if plan.layout.rollout_tp != 1:
        raise ValueError(
            f"rank_tensors_as_hf: {plan.layout} gives each worker part of the tensors; "
            "only rollout TP 1 receives whole ones"
        )
    params = iter(plan.params)
    for _, tensor in tensors:
        param = next(params)
        rows = [shape[0] for shape in param.hf_shapes]
        if param.kind in ROW_BLOCK_KINDS:
            yield from zip(param.hf_names, tensor.split(rows))
        else:
            yield param.hf_names[0], tensor[: rows[0]] if param.kind == VOCAB else tensor
