"""The weight-sync bridge: Megatron shards → rollout engines, after every training step.

`plan` (pure: units, send order, buckets; cached per layout pair), `convert` (pure: TP gather to HF
tensors, per-rank regroup), `collect` (the trainer-world collectives that assemble the buckets),
`transports` (in-process, shared memory, CUDA IPC), `sync` (the procedure through a transport),
`shard_send` (each trainer rank sends its own shards over the sync group), `per_rank` (each TP
rank's shards through its own shared ring), `checksum` (the exact check: every tensor an engine
loaded against the actor's shards, bit for bit), `verify` (the log-prob check).
"""

from megarl.bridge.plan import LayoutPair, SyncPlan, build_plan
from megarl.bridge.sync import SyncStats, WeightSender, receiving, sync_in_process
from megarl.bridge.verify import SyncVerificationError, check_sync, probe_token_ids

__all__ = [
    "LayoutPair",
    "SyncPlan",
    "SyncStats",
    "SyncVerificationError",
    "WeightSender",
    "build_plan",
    "check_sync",
    "probe_token_ids",
    "receiving",
    "sync_in_process",
]
