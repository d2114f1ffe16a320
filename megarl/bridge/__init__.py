"""The weight-sync bridge: Megatron shards → rollout engines, after every training step. Each
transport is one place holding both its halves; rollout backends take weights only through the
names exported here (a sync reaches an engine as one of the `transports.sources` records, which its
`receive` takes), and nothing in this package imports a rollout backend (`LoadsWeights` is the little it
needs of an engine).

Pure: `plan` (units, send order, buckets, the shard sync's schedule; cached per layout pair), `convert` (TP gather to HF
tensors, per-rank regroup), `protocol` (the bucket format both halves share). Trainer side:
`collect` (the trainer-world collectives that assemble the buckets), `sync` (one sync through a
transport). Transports, sender and receiver each: `transports` (in-process, shared memory and its
CUDA IPC buffers, keyed by device UUID), `shared_ring` (the two-slot ring those share: `RingSender` /
`read_ring`), `ring_routes` (which trainer rank's ring each engine worker reads: colocated, its own
device's), `per_rank` (each TP rank's shards through its own ring, read by `workers/rollout/rank_load`),
`shard_sync` (each trainer rank sends each vLLM worker the pieces of its TP shard over the
`sync_group`, as the planner's schedule says). Checks:
`checksum` (every tensor an engine loaded against the actor's shards, bit for bit), `verify`
(the log-prob check).
"""

from megarl.bridge.checksum import LoadedChecksums, VllmRankLayout, recorded
from megarl.bridge.plan import LayoutPair, SyncPlan, build_plan
from megarl.bridge.protocol import BucketMetadata, SharedBucket, TensorSlot, pack, unpack
from megarl.bridge.schedule import build_schedule, receiver_rank, sender_rank
from megarl.bridge.shard_sync import ShardSender, rank_tensors_as_hf, receive_rank_shards
from megarl.bridge.shared_ring import RingReader, SharedRing, read_ring
from megarl.bridge.sync import SyncStats, WeightSender, receiving, sync_in_process
from megarl.bridge.sync_group import create_weight_sync_group
from megarl.bridge.transports.base import LoadsWeights
from megarl.bridge.transports.sources import CollectivePlan, InProcessTensors, RankRings, SharedRings, WeightSource
from megarl.bridge.verify import SyncVerificationError, check_sync, probe_token_ids

__all__ = [
    "BucketMetadata",
    "CollectivePlan",
    "InProcessTensors",
    "LayoutPair",
    "LoadedChecksums",
    "LoadsWeights",
    "RankRings",
    "RingReader",
    "ShardSender",
    "SharedBucket",
    "SharedRing",
    "SharedRings",
    "SyncPlan",
    "SyncStats",
    "SyncVerificationError",
    "TensorSlot",
    "VllmRankLayout",
    "WeightSender",
    "WeightSource",
    "build_plan",
    "build_schedule",
    "check_sync",
    "create_weight_sync_group",
    "pack",
    "probe_token_ids",
    "rank_tensors_as_hf",
    "read_ring",
    "receive_rank_shards",
    "receiver_rank",
    "receiving",
    "recorded",
    "sender_rank",
    "sync_in_process",
    "unpack",
]
