"""The trainer side of a sync: turn this world's Megatron shards into the plan's buckets on global
rank 0, one bucket at a time.

Every rank of the trainer world runs `collect_buckets` in lockstep. For each bucket, the stage that
owns it (DP replica 0 only: the other replicas hold the same weights) gathers each parameter's TP
shards onto its TP rank 0, which converts them to HF tensors (`convert.to_hf`) straight into the
bucket's flat buffer; a bucket of a later stage then travels point-to-point to global rank 0 over
the pipeline group. Rank 0, the sender, gets `(flat, metadata)` per bucket, the other ranks None.

Memory: the sender holds one flat buffer plus one parameter's gathered shards and HF tensors at a
time; `BufferMeter` accounts for those bytes (the "peak extra memory" of a sync).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.bridge.convert import to_hf
from megarl.bridge.plan import PlannedBucket, PlannedParam, SyncPlan
from megarl.models.layout import VOCAB, param_mapping, reader_of, tp_shard_from_hf
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.rollout.weight_sync_protocol import BucketMetadata

SENDER_RANK = 0
"""Global rank that assembles every bucket and hands it to the transport (TP 0, PP 0, DP 0)."""


@dataclass
class BufferMeter:
    """Bytes of the buffers the bridge holds on this rank, now and at most (its extra memory)."""

    live: int = 0
    """Bytes held now."""
    peak: int = 0
    """Most bytes held at once since construction."""

    def hold(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def release(self, nbytes: int) -> None:
        self.live -= nbytes


def local_params_by_plan_name(
    plan: SyncPlan, named_parameters: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """This rank's tensors keyed by the plan's Megatron names. `named_parameters` are global-layer
    Megatron names (`MegatronActor.named_parameters_for_sync`); they are matched to the plan by the
    HF tensors they map to, so Transformer-Engine names (`linear_qkv.layer_norm_weight`) work too.
    With tied embeddings the last stage's `output_layer.weight` copy is not sent."""
    by_hf_names = {p.hf_names: p.megatron_name for p in plan.params}
    local = {}
    for name, tensor in named_parameters:
        if name == "output_layer.weight" and plan.dims.tie_word_embeddings:
            continue
        hf_names = param_mapping(name, plan.dims).hf_names
        if hf_names not in by_hf_names:
            raise ValueError(
                f"Megatron parameter {name} maps to {hf_names}, which the sync plan for {plan.layout} does not send"
            )
        local[by_hf_names[hf_names]] = tensor
    return local


def _gather_shards(
    param: PlannedParam, shard: torch.Tensor, groups: ProcessGroups, meter: BufferMeter
) -> list[torch.Tensor] | None:
    """All TP shards of `param` on TP rank 0 (rank order), None on the other TP ranks."""
    shard = shard.detach()
    if not param.needs_tp_gather or groups.tp_size == 1:
        return [shard] if groups.tp_rank == 0 else None
    shard = shard.contiguous()
    shards = [torch.empty_like(shard) for _ in range(groups.tp_size)] if groups.tp_rank == 0 else None
    if shards is not None:
        meter.hold(shard.nbytes * groups.tp_size)
    dist.gather(shard, shards, dst=dist.get_global_rank(groups.tp, 0), group=groups.tp)
    return shards


def _assemble(
    bucket: PlannedBucket, local: dict[str, torch.Tensor], plan: SyncPlan, groups: ProcessGroups, meter: BufferMeter
) -> torch.Tensor | None:
    """The bucket's flat buffer on the owning stage's TP rank 0 (None on its other TP ranks)."""
    metadata = bucket.metadata
    flat = None
    if groups.tp_rank == 0:
        flat = torch.empty(metadata.numel, dtype=metadata.dtype)
        meter.hold(flat.nbytes)
    slots = iter(metadata.slots)
    for param in bucket.params:
        if param.megatron_name not in local:
            raise KeyError(
                f"weight sync: this rank (PP stage {groups.pp_rank}) has no parameter {param.megatron_name} "
                "that the plan expects here"
            )
        shards = _gather_shards(param, local[param.megatron_name], groups, meter)
        if shards is None:
            continue
        gathered = sum(s.nbytes for s in shards) if len(shards) > 1 else 0
        for name, tensor in to_hf(param, shards, plan.dims):
            slot = next(slots)
            if slot.name != name:
                raise RuntimeError(f"weight sync: {param.megatron_name} gave {name} where the plan expects {slot.name}")
            flat[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
        meter.release(gathered)
    return flat


def _to_sender(
    flat: torch.Tensor | None, bucket: PlannedBucket, groups: ProcessGroups, meter: BufferMeter
) -> torch.Tensor | None:
    """Move a later stage's bucket to the sender over the pipeline group of TP 0 / DP 0."""
    if bucket.pp_rank == 0 or groups.tp_rank != 0 or groups.dp_rank != 0:
        return flat
    if groups.pp_rank == bucket.pp_rank:
        dist.send(flat, dst=dist.get_global_rank(groups.pp, 0), group=groups.pp)
        meter.release(flat.nbytes)
        return None
    if groups.pp_rank == 0:
        flat = torch.empty(bucket.metadata.numel, dtype=bucket.metadata.dtype)
        meter.hold(flat.nbytes)
        dist.recv(flat, src=dist.get_global_rank(groups.pp, bucket.pp_rank), group=groups.pp)
    return flat


def collect_buckets(
    plan: SyncPlan, local: dict[str, torch.Tensor], groups: ProcessGroups, meter: BufferMeter, *, every_rank: bool
) -> Iterator[tuple[torch.Tensor, BucketMetadata] | None]:
    """Run on every trainer rank, consuming it fully; yields `(flat [numel], metadata)` per bucket
    on `SENDER_RANK`, None elsewhere; with `every_rank`, on every rank of the trainer world (each
    rank colocated with its own engine: the sender broadcasts each bucket over the world). The
    consumer must drop each flat buffer before asking for the next one (the meter counts it
    released at that point)."""
    receives = every_rank or dist.get_rank() == SENDER_RANK
    for bucket in plan.buckets:
        flat = None
        if groups.dp_rank == 0 and groups.pp_rank == bucket.pp_rank:
            flat = _assemble(bucket, local, plan, groups, meter)
        flat = _to_sender(flat, bucket, groups, meter)
        if every_rank:
            if flat is None:
                flat = torch.empty(bucket.metadata.numel, dtype=bucket.metadata.dtype)
                meter.hold(flat.nbytes)
            dist.broadcast(flat, src=SENDER_RANK)
        yield (flat, bucket.metadata) if receives else None
        if flat is not None:
            meter.release(flat.nbytes)


def conversion_errors(plan: SyncPlan, local: dict[str, torch.Tensor], groups: ProcessGroups) -> list[str]:
    """Megatron names whose HF tensors do not turn back into the rank's shards (collective over
    the trainer world; every rank gets the whole list).

    The check inverts the conversion with the checkpoint loader's slicing (`tp_shard_from_hf`),
    so a wrong merge (e.g. gate/up joined naively) names its parameter."""
    errors = []
    meter = BufferMeter()
    for bucket in plan.buckets:
        if groups.dp_rank != 0 or groups.pp_rank != bucket.pp_rank:
            continue
        for param in bucket.params:
            shards = _gather_shards(param, local[param.megatron_name], groups, meter)
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
