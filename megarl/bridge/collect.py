"""The trainer side of a sync: turn this world's Megatron shards into the plan's buckets on global
rank 0, one bucket at a time.

Every rank of the trainer world runs `collect_buckets` in lockstep. For each bucket, the stage that
owns it (DP replica 0 only: the other replicas hold the same weights) gathers each parameter's TP
shards onto its TP rank 0, which converts them to HF tensors (`convert.to_hf_into`) straight into
the bucket's flat buffer; a bucket of a later stage then travels point-to-point to global rank 0 over
the pipeline group. Rank 0, the sender, gets `(flat, metadata)` per bucket, the other ranks None.

Memory: the sender holds two flat buffers at a time (one handed to the transport, the next being
assembled by a thread meanwhile) plus, on TP rank 0 of a TP > 1 layout, one buffer for the other
ranks' shards of a row-parallel or vocabulary parameter, reused for all (`GatherBuffer`; qkv and
gate/up shards are received straight into their rows of the bucket). HF tensors are written
straight into the flat buffer, never made on their own. `BufferMeter` accounts for those bytes
(the "peak extra memory" of a sync).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.bridge.convert import check_hf_shapes, mapping_of, to_hf, to_hf_into
from megarl.bridge.plan import LayoutPair, PlannedBucket, PlannedParam, SyncPlan
from megarl.bridge.protocol import BucketMetadata
from megarl.bridge.schedule import expert_owner, sender_rank, stage_index
from megarl.models.layout import (
    ROW_BLOCK_KINDS,
    VOCAB,
    expert_offset,
    param_mapping,
    reader_of,
    shard_pieces,
    tp_shard_from_hf,
)
from megarl.parallel.device import uses_cuda
from megarl.parallel.distributed import ProcessGroups

SENDER_RANK = 0
"""Global rank that assembles every bucket and hands it to the transport (TP 0, PP 0, DP 0)."""


@dataclass
class BufferMeter:
    """Bytes of the buffers the bridge holds on this rank, now and at most (its extra memory)."""

    live: int = 0
    """Bytes held now."""
    peak: int = 0
    """Most bytes held at once since construction."""

    def __post_init__(self):
        self._lock = threading.Lock()  # the assembling thread holds, the consumer's releases

    def hold(self, nbytes: int) -> None:
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes


def local_params_by_plan_name(
    plan: SyncPlan, named_parameters: Iterable[tuple[str, torch.Tensor]], groups: ProcessGroups
) -> dict[str, torch.Tensor]:
    """This rank's tensors keyed by the plan's Megatron names. `named_parameters` are global-layer
    Megatron names (`MegatronActor.named_parameters_for_sync`); they are matched to the plan by the
    HF tensors they map to, so Transformer-Engine names (`linear_qkv.layer_norm_weight`) work too.
    Expert names count this EP rank's experts from 0 (megatron's `local_experts.{e}`): `groups`' EP
    rank makes them global (the plan's). With tied embeddings the last stage's `output_layer.weight`
    copy is not sent."""
    by_hf_names = {p.hf_names: p.megatron_name for p in plan.params}
    experts = expert_offset(plan.dims, groups.ep_size, groups.ep_rank) if plan.dims.num_experts else 0
    local = {}
    for name, tensor in named_parameters:
        if name == "output_layer.weight" and plan.dims.tie_word_embeddings:
            continue
        hf_names = param_mapping(name, plan.dims, expert_offset=experts).hf_names
        if hf_names not in by_hf_names:
            raise ValueError(
                f"Megatron parameter {name} maps to {hf_names}, which the sync plan for {plan.layout} does not send"
            )
        local[by_hf_names[hf_names]] = tensor
    return local


@dataclass(frozen=True)
class ShardGroup:
    """The ranks a parameter is cut over: the TP group, or an expert's expert-TP group."""

    group: dist.ProcessGroup | None
    size: int
    rank: int


def shard_group(param: PlannedParam, groups: ProcessGroups) -> ShardGroup:
    """The group `param`'s shards are cut over on this rank."""
    if param.expert >= 0:
        return ShardGroup(groups.etp, groups.etp_size, groups.etp_rank)
    return ShardGroup(groups.tp, groups.tp_size, groups.tp_rank)


def holds_shard(param: PlannedParam, plan: SyncPlan, groups: ProcessGroups) -> bool:
    """Whether this rank holds the copy of `param` the sync sends: DP replica 0's on its stage; an
    expert's, its EP rank's in the first expert-DP replica."""
    if groups.pp_rank != param.pp_rank:
        return False
    if param.expert < 0:
        return groups.dp_rank == 0
    return groups.expert_dp_rank == 0 and expert_owner(plan.dims, plan.layout, param.expert) == groups.ep_rank


def sync_rank(layout: LayoutPair, groups: ProcessGroups) -> int | None:
    """This trainer rank's sync-group rank (`schedule.sender_rank`), None when it sends nothing (outside
    DP replica 0 and the first expert-DP replica)."""
    index = stage_index(
        layout,
        tp_rank=groups.tp_rank,
        dp_rank=groups.dp_rank,
        etp_rank=groups.etp_rank,
        ep_rank=groups.ep_rank,
        expert_dp_rank=groups.expert_dp_rank,
    )
    return None if index is None else sender_rank(layout, groups.pp_rank, index)


class GatherBuffer:
    """Where TP rank 0 of a TP > 1 layout receives the other ranks' shards of the parameters that
    are not received straight into their slots: one buffer for all of them, grown to the largest
    (counted by `meter`). A fresh buffer per parameter would cost its page faults every time."""

    def __init__(self, meter: BufferMeter):
        self.meter = meter
        self._buffer: torch.Tensor | None = None

    def others(self, shard: torch.Tensor, others: int) -> list[torch.Tensor]:
        """`others` views `[*shard.shape]` of the buffer, for (expert-)TP ranks 1.. in order (the
        previous parameter's are overwritten)."""
        if self._buffer is None or self._buffer.numel() < shard.numel() * others:
            self.release()
            self._buffer = torch.empty(shard.numel() * others, dtype=shard.dtype, device=shard.device)
            self.meter.hold(self._buffer.nbytes)
        return list(self._buffer[: shard.numel() * others].view(others, *shard.shape))

    def release(self) -> None:
        if self._buffer is not None:
            self.meter.release(self._buffer.nbytes)
            self._buffer = None


def gather_shards(
    param: PlannedParam, shard: torch.Tensor, groups: ProcessGroups, gathered: GatherBuffer
) -> list[torch.Tensor] | None:
    """All TP (an expert's: expert-TP) shards of `param` on that group's rank 0 (rank order: its own,
    in place, then views of `gathered`), None on the group's other ranks. Point-to-point rather than
    `dist.gather`, which copies the root's own shard and receives into a fresh flat buffer of its own
    before copying out."""
    shard = shard.detach()
    cut = shard_group(param, groups)
    if not param.needs_tp_gather or cut.size == 1:
        return [shard] if cut.rank == 0 else None
    shard = shard.contiguous()
    if cut.rank != 0:
        dist.send(shard, dst=dist.get_global_rank(cut.group, 0), group=cut.group)
        return None
    others = gathered.others(shard, cut.size - 1)
    receives = [
        dist.irecv(view, src=dist.get_global_rank(cut.group, rank), group=cut.group)
        for rank, view in enumerate(others, start=1)
    ]
    for receive in receives:
        receive.wait()
    return [shard, *others]


def _assemble(
    bucket: PlannedBucket,
    local: dict[str, torch.Tensor],
    plan: SyncPlan,
    groups: ProcessGroups,
    gathered: GatherBuffer,
    meter: BufferMeter,
    device: torch.device,
) -> torch.Tensor | None:
    """The bucket's flat buffer on the owning stage's TP rank 0 (None on its other TP ranks): each
    parameter written straight into its slots, no HF tensor of its own. With TP > 1, qkv and
    gate/up shards are received straight into their rows (`_receive_into`); the other kinds
    through `gathered` and `to_hf_into`."""
    metadata = bucket.metadata
    flat = None
    if groups.tp_rank == 0:
        flat = torch.empty(metadata.numel, dtype=metadata.dtype, device=device)
        meter.hold(flat.nbytes)
    slots = iter(metadata.slots)
    for param in bucket.params:
        if param.megatron_name not in local:
            raise KeyError(
                f"weight sync: this rank (PP stage {groups.pp_rank}) has no parameter {param.megatron_name} "
                "that the plan expects here"
            )
        shard = local[param.megatron_name].detach()
        in_rows = groups.tp_size > 1 and param.kind in ROW_BLOCK_KINDS
        if groups.tp_rank != 0:
            if in_rows:
                _send_pieces(param, shard, groups, plan)
            else:
                gather_shards(param, shard, groups, gathered)
            continue
        views = []
        for name in param.hf_names:
            slot = next(slots)
            if slot.name != name:
                raise RuntimeError(
                    f"weight sync: {param.megatron_name} gives {name} where the plan expects {slot.name}"
                )
            views.append(flat[slot.offset : slot.offset + slot.numel].view(slot.shape))
        if in_rows:
            _receive_into(param, shard, groups, plan, views)
        else:
            to_hf_into(param, gather_shards(param, shard, groups, gathered), plan.dims, views)
    return flat


def _send_pieces(param: PlannedParam, shard: torch.Tensor, groups: ProcessGroups, plan: SyncPlan) -> None:
    """A TP rank > 0's half of `_receive_into`: its shard's pieces, in order, to TP rank 0, cast to the
    plan's dtype (they land straight in the bucket's rows)."""
    for piece, _ in shard_pieces(mapping_of(param), shard, plan.dims, groups.tp_rank):
        dist.send(piece.to(plan.dtype).contiguous(), dst=dist.get_global_rank(groups.tp, 0), group=groups.tp)


def _receive_into(
    param: PlannedParam, shard: torch.Tensor, groups: ProcessGroups, plan: SyncPlan, outs: list[torch.Tensor]
) -> None:
    """TP rank 0: every rank's shard of a `ROW_BLOCK_KINDS` parameter into its rows of `outs` (the
    HF tensors' slots): its own by copy, the others' received in place (Megatron's TP shards of a
    parameter all have this rank's shape)."""
    check_hf_shapes(param, [tuple(shard.shape)] * groups.tp_size, plan.dims)
    receives = []
    for rank in [*range(1, groups.tp_size), 0]:  # the receives run while this rank copies its own
        for out, (piece, rows) in zip(outs, shard_pieces(mapping_of(param), shard, plan.dims, rank)):
            target = out[rows].view(piece.shape)
            if rank == 0:
                target.copy_(piece)
            else:
                receives.append(dist.irecv(target, src=dist.get_global_rank(groups.tp, rank), group=groups.tp))
    for receive in receives:
        receive.wait()


def _to_sender(
    flat: torch.Tensor | None, bucket: PlannedBucket, groups: ProcessGroups, meter: BufferMeter, device: torch.device
) -> torch.Tensor | None:
    """Move a later stage's bucket to the sender over the pipeline group of TP 0 / DP 0."""
    if bucket.pp_rank == 0 or groups.tp_rank != 0 or groups.dp_rank != 0:
        return flat
    if groups.pp_rank == bucket.pp_rank:
        dist.send(flat, dst=dist.get_global_rank(groups.pp, 0), group=groups.pp)
        meter.release(flat.nbytes)
        return None
    if groups.pp_rank == 0:
        flat = torch.empty(bucket.metadata.numel, dtype=bucket.metadata.dtype, device=device)
        meter.hold(flat.nbytes)
        dist.recv(flat, src=dist.get_global_rank(groups.pp, bucket.pp_rank), group=groups.pp)
    return flat


def collect_buckets(
    plan: SyncPlan, local: dict[str, torch.Tensor], groups: ProcessGroups, meter: BufferMeter, *, every_rank: bool
) -> Iterator[tuple[torch.Tensor, BucketMetadata] | None]:
    """Run on every trainer rank, consuming it fully; yields `(flat [numel], metadata)` per bucket
    on `SENDER_RANK`, None elsewhere; with `every_rank`, on every rank of the trainer world (each
    rank colocated with its own engine: the sender broadcasts each bucket over the world).

    One thread assembles bucket i + 1 (gathers, conversion, moves between stages) while the
    consumer sends bucket i, so the bridge holds at most two buckets plus one gathered parameter.
    The thread issues every trainer-world collective of the sync, in plan order on every rank.
    Each bucket is a buffer of its own, handed over to the consumer: an engine may hold several
    (`HFRolloutEngine.receive(InProcessTensors(...))` keeps them all until it loads). The meter counts a bucket
    released when the next one is asked for: the bridge's own memory, not the consumer's."""
    receives = every_rank or dist.get_rank() == SENDER_RANK
    gathered = GatherBuffer(meter)
    # Buckets live where the weights do (a GPU's for NCCL and CUDA IPC); the thread uses this
    # thread's current GPU.
    device = next(iter(local.values())).device if local else torch.device("cpu")
    cuda = torch.cuda.current_device() if uses_cuda() else None

    def produce(bucket: PlannedBucket) -> torch.Tensor | None:
        with torch.no_grad(), torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext():
            flat = None
            if groups.dp_rank == 0 and groups.pp_rank == bucket.pp_rank:
                flat = _assemble(bucket, local, plan, groups, gathered, meter, device)
            flat = _to_sender(flat, bucket, groups, meter, device)
            if every_rank:
                if flat is None:
                    flat = torch.empty(bucket.metadata.numel, dtype=bucket.metadata.dtype, device=device)
                    meter.hold(flat.nbytes)
                dist.broadcast(flat, src=SENDER_RANK)
            return flat

    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-sync-assemble") as assembler:
            next_flat = assembler.submit(produce, plan.buckets[0])
            for i, bucket in enumerate(plan.buckets):
                flat = next_flat.result()
                if i + 1 < len(plan.buckets):
                    next_flat = assembler.submit(produce, plan.buckets[i + 1])
                yield (flat, bucket.metadata) if receives else None
                if flat is not None:
                    meter.release(flat.nbytes)
    finally:
        gathered.release()


def conversion_errors(plan: SyncPlan, local: dict[str, torch.Tensor], groups: ProcessGroups) -> list[str]:
    """Megatron names whose HF tensors do not turn back into the rank's shards (collective over
    the trainer world; every rank gets the whole list). Each parameter is gathered over the group it
    is cut over by the ranks holding the copy the sync sends (`holds_shard`).

    The check inverts the conversion with the checkpoint loader's slicing (`tp_shard_from_hf`),
    so a wrong merge (e.g. gate/up joined naively) names its parameter."""
    errors = []
    gathered = GatherBuffer(BufferMeter())
    for param in plan.params:
        if holds_shard(param, plan, groups):
            shards = gather_shards(param, local[param.megatron_name], groups, gathered)
            if shards is not None and not round_trips(param, shards, plan):
                errors.append(param.megatron_name)
    per_rank: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(per_rank, errors)
    return [name for param in plan.params for name in [param.megatron_name] if any(name in e for e in per_rank)]


def round_trips(param: PlannedParam, shards: list[torch.Tensor], plan: SyncPlan) -> bool:
    """Whether `to_hf(shards)` re-sharded by the loader's slicing gives `shards` back (vocabulary
    padding rows excepted: they are trimmed, not sent)."""
    dims = plan.dims
    read = reader_of(dict(to_hf(param, shards, dims)))
    mapping = param_mapping(param.megatron_name, dims)
    tp_size = len(shards)
    # Rows per rank as the divisor makes the loader pad to exactly the shards' padded vocabulary.
    divisible_by = shards[0].shape[0] if param.kind == VOCAB else 1
    rebuilt = [
        tp_shard_from_hf(mapping, read, dims, tp_size=tp_size, tp_rank=r, vocab_divisible_by=divisible_by)
        for r in range(tp_size)
    ]
    if param.kind == VOCAB:
        return torch.equal(torch.cat(rebuilt)[: dims.vocab_size], torch.cat(shards)[: dims.vocab_size])
    return all(torch.equal(a, b) for a, b in zip(rebuilt, shards))
