"""The per-rank sync: train TP == rollout TP, engine on the trainer's node. Each TP rank's shards
already are vLLM worker r's tensors (`convert.to_vllm_rank`: gate/up, o_proj, down_proj as they
are, qkv regrouped within the rank), so no rank gathers a full tensor: every TP rank of DP replica
0, on every stage, writes its own shards into shared-memory buckets, and vLLM worker r maps the
buckets of train TP rank r (`rank_load`). Only the vocabulary (embedding, untied LM head) is
gathered and sent as full HF tensors, because Megatron and vLLM pad it differently.

    sender = PerRankSender(plan, actor.named_parameters_for_sync, groups, deliver)  # deliver on rank 0
    stats = sender.send()   # collective over the trainer world

`deliver(by_rank, full)` (global rank 0 only) hands the handles of the whole sync to the engine and
returns once it has loaded them, e.g. `VLLMRolloutEngine.load_rank_buckets`
inside `pause()`/`resume()`. Every rank then removes its own files.

Memory: each sending rank holds its own shards of the model once more, in /dev/shm, until the
engine has loaded them: 1/TP of the model per rank, one whole copy per node, not the two buckets
of the streaming transports (`shared_memory`, `broadcast`). Not yet chosen by the trainer: this is
the building block for colocated GPUs (CUDA IPC handles instead of files), where the gather it
saves matters.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.bridge.collect import BufferMeter, GatherBuffer, gather_shards, local_params_by_plan_name
from megarl.bridge.convert import to_hf, to_vllm_rank
from megarl.bridge.plan import PlannedParam, SyncPlan
from megarl.bridge.transports.shared_memory import SHM_DIR, ShmBucket, new_slot_file
from megarl.models.layout import VOCAB
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.rollout.weight_sync_protocol import BucketMetadata, TensorSlot

DELIVERING_RANK = 0
"""Global rank that hands the whole sync's handles to the engine."""

Deliver = Callable[[Mapping[int, Sequence[ShmBucket]], Sequence[ShmBucket]], None]
"""`(by_rank, full)` → the engine loads them: `by_rank[r]`, vLLM TP rank r's own tensors; `full`, full
HF tensors for every worker. Returns once loaded."""

NamedParameters = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class PerRankStats:
    """What one `send` did on this rank."""

    seconds: float
    """Wall time of the whole send, delivery included."""
    rank_bytes: int
    """Bytes of this rank's own per-rank tensors written to shared memory (its shards)."""
    full_bytes: int
    """Bytes of full (vocabulary) tensors this rank wrote (TP rank 0 of the owning stage)."""
    buckets: int
    """Buckets this rank wrote."""


class PerRankSender:
    """The trainer side of the per-rank sync for one plan (built once, reused every step)."""

    def __init__(
        self, plan: SyncPlan, named_parameters: NamedParameters, groups: ProcessGroups,
        deliver: Deliver | None, *, directory: str = SHM_DIR,
    ):
        """`deliver`: on global rank `DELIVERING_RANK`, the way to the engine; None elsewhere."""
        layout = plan.layout
        if layout.train_tp != layout.rollout_tp:
            raise ValueError(
                f"per-rank weight sync needs train TP == rollout TP, got {layout}; use the gathering sync "
                f"(megarl.bridge.sync.WeightSender) for other layouts"
            )
        if not os.path.isdir(directory):
            raise RuntimeError(
                f"per-rank weight sync: {directory} does not exist; it needs a Linux tmpfs there (the engine "
                f"must be on this node) or use the gathering sync (megarl.bridge.sync.WeightSender)"
            )
        self.plan, self.named_parameters, self.groups = plan, named_parameters, groups
        self.deliver, self.directory = deliver, directory
        self.bucket_bytes = plan.bucket_bytes
        self.dtype = plan.buckets[0].metadata.dtype

    def send(self) -> PerRankStats:
        """Collective over the trainer world."""
        start = time.perf_counter()
        shared: list[ShmBucket] = []
        counts = {"rank": 0, "full": 0}
        error = None
        try:
            with torch.no_grad():
                rank_buckets, full_buckets = self._write_buckets(shared, counts)
            everyone = [None] * dist.get_world_size() if dist.get_rank() == DELIVERING_RANK else None
            dist.gather_object((self.groups.tp_rank, rank_buckets, full_buckets), everyone, dst=DELIVERING_RANK)
            if everyone is not None:
                try:
                    self.deliver(*_by_rank(everyone, self.groups.tp_size))
                except Exception as failure:  # re-raised below, once every rank knows
                    error = failure
            # Every rank keeps its files until the engine has loaded them.
            failed = [error is not None]
            dist.broadcast_object_list(failed, src=DELIVERING_RANK)
        finally:
            for bucket in shared:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(bucket.path)
        if error is not None:
            raise error
        if failed[0]:
            raise RuntimeError(f"per-rank weight sync: the delivery on global rank {DELIVERING_RANK} failed")
        return PerRankStats(time.perf_counter() - start, counts["rank"], counts["full"], len(shared))

    def _write_buckets(
        self, shared: list[ShmBucket], counts: dict[str, int]
    ) -> tuple[list[ShmBucket], list[ShmBucket]]:
        """This rank's per-rank buckets and full-tensor (vocabulary) buckets, both empty outside DP
        replica 0; every file also goes into `shared`, and its bytes into `counts` by kind."""
        groups = self.groups
        rank_buckets: list[ShmBucket] = []
        full_buckets: list[ShmBucket] = []
        if groups.dp_rank != 0:
            return rank_buckets, full_buckets
        local = local_params_by_plan_name(self.plan, self.named_parameters())
        gathered = GatherBuffer(groups, BufferMeter())
        pending = {"rank": [], "full": []}
        outs = {"rank": rank_buckets, "full": full_buckets}

        def flush(kind: str) -> None:
            if pending[kind]:
                bucket = _write_bucket(pending[kind], self.dtype, self.directory, shared)
                outs[kind].append(bucket)
                counts[kind] += bucket.metadata.numel * self.dtype.itemsize
                pending[kind] = []

        def add(kind: str, named: list[tuple[str, torch.Tensor]]) -> None:
            pending[kind].extend(named)  # views of the live shards: the bucket's file is their one copy
            if sum(t.numel() for _, t in pending[kind]) * self.dtype.itemsize >= self.bucket_bytes:
                flush(kind)

        try:
            for param in self._stage_params():
                shard = local[param.megatron_name].detach()
                if param.kind == VOCAB:
                    shards = gather_shards(param, shard, groups, gathered)  # point-to-point to TP rank 0
                    if shards is not None:
                        add("full", to_hf(param, shards, self.plan.dims))
                else:
                    add("rank", [to_vllm_rank(param, shard, self.plan.dims, groups.tp_size)])
            flush("rank")
            flush("full")
        finally:
            gathered.release()
        return rank_buckets, full_buckets

    def _stage_params(self) -> list[PlannedParam]:
        return [param for param in self.plan.params if param.pp_rank == self.groups.pp_rank]


def _by_rank(
    everyone: list[tuple[int, list[ShmBucket], list[ShmBucket]]], tp_size: int
) -> tuple[dict[int, list[ShmBucket]], list[ShmBucket]]:
    """Every rank's handles grouped by TP rank (all stages of one TP rank together), and the full ones."""
    by_rank: dict[int, list[ShmBucket]] = {rank: [] for rank in range(tp_size)}
    full: list[ShmBucket] = []
    for tp_rank, rank_buckets, full_buckets in everyone:
        by_rank[tp_rank].extend(rank_buckets)
        full.extend(full_buckets)
    return by_rank, full


def _write_bucket(
    named: list[tuple[str, torch.Tensor]], dtype: torch.dtype, directory: str, shared: list[ShmBucket]
) -> ShmBucket:
    """One bucket of `named` in `dtype` in a new file of `directory`, each tensor copied (and cast)
    once, straight into its slot; appended to `shared` as soon as the file exists (the caller unlinks)."""
    slots, offset = [], 0
    for name, tensor in named:
        slots.append(TensorSlot(name, tuple(tensor.shape), dtype, offset))
        offset += tensor.numel()
    path = new_slot_file(directory)
    bucket = ShmBucket(BucketMetadata(tuple(slots)), path)
    shared.append(bucket)
    flat = bucket.open(torch.device("cpu"))
    for slot, (_, tensor) in zip(slots, named):
        flat[slot.offset : slot.offset + slot.numel].view(slot.shape).copy_(tensor)
    return bucket
