"""Collective transport: broadcast each bucket over a dedicated process group from the sender
(rank 0) to the rollout workers (gloo on CPU, NCCL on GPU), whose `worker_extension` receives and
loads them (`RolloutEngine.receive_weights`, started by whoever drives the engine)."""

from __future__ import annotations

import torch.distributed as dist

from megarl.bridge.transports.base import Buckets, WeightTransport
from megarl.workers.rollout.sync_group import broadcast_bucket, create_weight_sync_group


class BroadcastTransport(WeightTransport):
    """Sender side of `megarl.workers.rollout.sync_group`. Several engines may share the group
    (each at its own `rank_offset`): one broadcast feeds them all."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    @classmethod
    def connect(
        cls, host: str, port: int, world_size: int, timeout_s: float, store: dist.Store | None = None
    ) -> BroadcastTransport:
        """Host the group's store at host:port as rank 0 (or use `store`, already listening there) and
        wait for the `world_size - 1` workers (their engines' `init_weight_sync` must run concurrently)."""
        return cls(create_weight_sync_group(host, port, 0, world_size, timeout_s, store=store))

    def send(self, buckets: Buckets) -> None:
        for flat, _ in buckets:
            broadcast_bucket(self.group, flat)
