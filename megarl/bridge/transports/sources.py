"""Weight sources: what the bridge hands a rollout engine's one receive entry point
(`RolloutEngine.receive(source)`), one small frozen record per way the weights arrive. The engine
looks the record's type up in its table of loaders; a kind it cannot take is refused by name.

    engine.receive(InProcessTensors(named_tensors))          # the sender's process (InProcessTransport)
    engine.receive(SharedRings({tp_rank: ring}))             # on the node, gathered HF buckets (shared_memory)
    engine.receive(RankRings({tp_rank: [ring per stage]}))   # on the node, each TP rank's own shards (per_rank)
    engine.receive(CollectivePlan(plan))                     # over the sync group (shard_sync)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from megarl.bridge.plan import SyncPlan
from megarl.bridge.shared_ring import SharedRing


@dataclass(frozen=True)
class InProcessTensors:
    """Full (unsharded) HF-named tensors handed over in the engine's own process: any subset of the
    model's tensors, provided every fused layer touched gets all its parts (q/k/v_proj together,
    gate/up_proj together) in this one source. The engine loads them before `receive` returns (the
    caller's thread produces a lazy stream: `InProcessTransport`)."""

    named_tensors: Iterable[tuple[str, torch.Tensor]]
    """`(HF name, tensor)` pairs; a lazy iterator is consumed as it comes."""


@dataclass(frozen=True)
class SharedRings:
    """One sync of gathered HF buckets that senders on the engine's node stream through their two shared
    slots (`shared_ring`: shared memory on CPU, CUDA IPC on the same GPU), read in place."""

    rings: Mapping[int, SharedRing]
    """The ring each engine TP rank reads (`ring_routes`: colocated, the ring of the trainer rank on
    its own device), keyed by every TP rank of the engine."""


@dataclass(frozen=True)
class RankRings:
    """One per-rank sync (`per_rank`, train TP == rollout TP): each engine TP rank loads its own shards,
    in the engine's per-rank names and shapes, straight from the rings of the trainer ranks of its TP
    rank (the engines whose capabilities have `per_rank_load`)."""

    rings_by_rank: Mapping[int, Sequence[SharedRing]]
    """Per engine TP rank, the rings of the trainer ranks of that TP rank, one per trainer stage in
    stage order."""


@dataclass(frozen=True)
class CollectivePlan:
    """One sync over the weight-sync group the engine joined (`init_weight_sync`): each engine worker
    receives from the trainer's ranks the pieces of its own TP shard (the plan's schedule, `shard_sync`)."""

    plan: SyncPlan
    """The run's sync plan, which the trainer's ranks send by."""


WeightSource = InProcessTensors | SharedRings | RankRings | CollectivePlan
"""Every way the bridge hands weights to an engine."""
