"""The per-rank sync: train TP == rollout TP, engines on the trainer's node. Each TP rank's shards
already are vLLM worker r's tensors (`convert.to_vllm_rank`: gate/up, o_proj, down_proj as they
are, qkv regrouped within the rank), so no rank gathers a full tensor: every ring-hosting rank
streams its own shards through its own shared ring (two slots, as the `shared_memory` transport),
and vLLM worker r reads the rings `ring_routes` gives it (`workers/rollout/rank_load`): colocated
(PP 1), the ring of the rank on its own device; split, those of TP rank r of DP replica 0, one per
stage. Only the vocabulary (embedding, untied LM head) is all-gathered over TP, because Megatron and
vLLM pad it differently: each TP rank sends vLLM rank r's rows of it (`convert.to_vllm_vocab_rank`).

    transport = SharedMemoryTransport(readers=routes.readers[rank]) if routes.readers[rank] else None
    sender = PerRankSender(plan, actor.named_parameters_for_sync, groups, transport)
    ring = sender.begin()         # each sync: None on ranks without a ring; the driver hands the rings
                                  # to the engines along the routes (`RolloutEngine.receive(RankRings(...))`)
    stats = sender.send()         # streams; returns once every engine has loaded this rank's ring

Memory per sending rank: the bucket being packed plus the ring's two slots (three buckets), not
a copy of its shards; with the vocabulary, one parameter's gathered shards.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megarl.bridge.collect import local_params_by_plan_name
from megarl.bridge.convert import to_hf, to_vllm_rank, to_vllm_vocab_rank
from megarl.bridge.plan import PlannedParam, SyncPlan
from megarl.bridge.protocol import BucketMetadata, pack
from megarl.bridge.shared_ring import SharedRing
from megarl.bridge.sync import BucketCount, NamedParameters, SyncStats
from megarl.bridge.transports.shared_memory import SharedMemoryTransport
from megarl.models.layout import VOCAB
from megarl.parallel.distributed import ProcessGroups

Named = Iterable[tuple[str, torch.Tensor]]


class PerRankSender:
    """The trainer side of the per-rank sync for one plan (built once, reused every step)."""

    def __init__(
        self,
        plan: SyncPlan,
        named_parameters: NamedParameters,
        groups: ProcessGroups,
        transport: SharedMemoryTransport | None,
    ):
        """`transport`: this rank's ring (a shared transport of `ring_routes`' readers) on the ranks
        that host one, whole TP groups of a DP replica; None elsewhere."""
        if plan.layout.train_tp != plan.layout.rollout_tp:
            raise ValueError(
                f"per-rank weight sync needs train TP == rollout TP, got {plan.layout}; use the gathering sync "
                f"(megarl.bridge.sync.WeightSender) for other layouts"
            )
        plan.layout.refuse_split_experts("the per-rank weight sync")
        self.plan, self.named_parameters, self.groups, self.transport = plan, named_parameters, groups, transport

    def begin(self) -> SharedRing | None:
        """Open this rank's ring for the next sync; None on ranks that send nothing."""
        return None if self.transport is None else self.transport.begin()

    def send(self) -> SyncStats:
        """Stream this rank's shards (collective over the TP group of its stage, for the vocabulary);
        returns once every engine has loaded them."""
        start = time.perf_counter()
        if self.transport is None:
            return SyncStats(0.0, 0, 0, 0)
        counted = BucketCount()
        with torch.no_grad():
            self.transport.send(counted.through(bucketed(self._tensors(), self.plan.bucket_bytes, self._dtype())))
        # The bucket being packed and the ring's slots are what a sync adds, at most.
        peak = counted.largest + self.transport.peak_shared_bytes
        return SyncStats(time.perf_counter() - start, counted.bytes, counted.buckets, peak)

    def _dtype(self) -> torch.dtype:
        return self.plan.dtype

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's tensors in vLLM worker `tp_rank`'s names and shapes, its stage's in plan order."""
        groups, dims = self.groups, self.plan.dims
        local = local_params_by_plan_name(self.plan, self.named_parameters(), groups)
        for param in self.plan.params:
            if param.pp_rank != groups.pp_rank:
                continue
            shard = local[param.megatron_name].detach()
            if param.kind == VOCAB:
                ((name, full),) = to_hf(param, self._all_gathered(param, shard), dims)
                yield name, to_vllm_vocab_rank(full, dims, groups.tp_size, groups.tp_rank)
            else:
                yield to_vllm_rank(param, shard, dims, groups.tp_size)

    def _all_gathered(self, param: PlannedParam, shard: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's shard of `param` (Megatron pads the vocabulary to equal shards)."""
        if self.groups.tp_size == 1:
            return [shard]
        shards = [torch.empty_like(shard) for _ in range(self.groups.tp_size)]
        dist.all_gather(shards, shard.contiguous(), group=self.groups.tp)
        return shards


def bucketed(named: Named, bucket_bytes: int, dtype: torch.dtype) -> Iterator[tuple[torch.Tensor, BucketMetadata]]:
    """`named` packed in order into flat `[numel]` buffers of `dtype` (each tensor copied, and cast,
    once), lazily: a buffer holds at most `bucket_bytes`, or one tensor larger than that alone."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * dtype.itemsize
        if pending and size + nbytes > bucket_bytes:
            yield pack(pending, dtype)
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield pack(pending, dtype)
