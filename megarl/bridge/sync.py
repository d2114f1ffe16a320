"""One weight sync through a transport, both halves: the full HF tensors of every bucket are
assembled on the trainer (TP shards gathered to their stage's TP rank 0, buckets sent by global
rank 0) and handed to an engine in the sender's process (`InProcessTransport`) or on its node (the
shared transports). Across processes and nodes, the trainer's ranks send their own shards instead
(`shard_sync`, received with `receiving` below).

Trainer side, every rank of the trainer world (`WeightSender.send` is collective; only global
rank 0 holds a transport, or every rank with `every_rank=True` when each has a colocated engine):

    sender = WeightSender(plan, actor.named_parameters_for_sync, groups, transport)
    stats = sender.send()

Engine side, whoever drives the rollout engine: `sync_in_process` when the engine is in the
sender's own process, or, for a sync group, around the trainer ranks' `ShardSender.send`:

    with receiving(engine, plan):          # pause; workers start receiving
        ...trainer ranks call sender.send()...
    # loaded; prefix cache flushed; weight_version + 1; resumed

Order of a sync: pause generation → per bucket (gather / convert / move / send) → prefix cache
reset → weight version bump → resume. A thread assembles the next bucket while the transport sends
the current one. Peak extra memory on the sender: two buckets plus, with train TP > 1, one
parameter's gathered shards (`SyncStats.peak_buffer_bytes`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from megarl.bridge.collect import BufferMeter, collect_buckets, conversion_errors, local_params_by_plan_name
from megarl.bridge.plan import SyncPlan
from megarl.bridge.transports.base import Buckets, LoadsWeights, WeightTransport
from megarl.bridge.transports.sources import CollectivePlan
from megarl.parallel.distributed import ProcessGroups

NamedParameters = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""This rank's live parameters under global-layer Megatron names (`MegatronActor.named_parameters_for_sync`)."""


@dataclass
class SyncStats:
    """What one `send` did on this rank."""

    seconds: float
    """Wall time of the whole send (gather, convert, move, transport)."""
    bytes_sent: int
    """Bytes handed to this rank's transport (0 on ranks without one)."""
    buckets: int
    """Buckets handed to this rank's transport (0 on ranks without one)."""
    peak_buffer_bytes: int
    """Most bytes of bridge buffers (flat buckets, gathered shards) alive at once on this rank."""

    def metrics(self) -> dict[str, float]:
        return {
            "sync/seconds": self.seconds,
            "sync/gigabytes": self.bytes_sent / 1e9,
            "sync/buckets": float(self.buckets),
            "sync/peak_buffer_megabytes": self.peak_buffer_bytes / 2**20,
        }


@dataclass
class BucketCount:
    """The buckets a transport consumed during one send."""

    bytes: int = 0
    """Bytes of all the buckets."""
    buckets: int = 0
    """How many there were."""
    largest: int = 0
    """Bytes of the largest one."""

    def through(self, buckets: Buckets) -> Buckets:
        """`buckets` as they are, counted as the transport asks for them."""
        for flat, metadata in buckets:
            self.bytes += flat.nbytes
            self.buckets += 1
            self.largest = max(self.largest, flat.nbytes)
            yield flat, metadata
            del flat  # the transport must drop a bucket before asking for the next one


class WeightSender:
    """The trainer side of the sync for one plan (built once per layout pair, reused every step)."""

    def __init__(
        self,
        plan: SyncPlan,
        named_parameters: NamedParameters,
        groups: ProcessGroups,
        transport: WeightTransport | None,
        *,
        every_rank: bool = False,
    ):
        """`transport`: on global rank 0 (the sender) the way to the engine; None on other ranks.
        `every_rank`: every rank of the trainer world has a transport and receives every bucket. Only
        for engines that must load full HF tensors: `megarl check-sync`'s in-process engine on
        every rank, and colocated rings where the per-rank load is off (`rollout.sync.per_rank:
        never`, the HF backend); colocated vLLM engines get the planner's pieces instead
        (`scheduled_ring`), which gather nothing."""
        plan.layout.refuse_split_experts("the gathering weight sync")
        self.plan = plan
        self.named_parameters = named_parameters
        self.groups = groups
        self.transport = transport
        self.every_rank = every_rank

    def _local(self) -> dict[str, torch.Tensor]:
        return local_params_by_plan_name(self.plan, self.named_parameters(), self.groups)

    def send(self) -> SyncStats:
        """Collective over the trainer world: every bucket of the plan reaches the transport."""
        start = time.perf_counter()
        meter = BufferMeter()
        counted = BucketCount()
        with torch.no_grad():
            buckets = collect_buckets(self.plan, self._local(), self.groups, meter, every_rank=self.every_rank)
            if self.transport is not None:
                self.transport.send(counted.through(buckets))
            for leftover in buckets:  # other ranks (and a transport that stopped early) drive the loop
                if leftover is not None:
                    raise RuntimeError(
                        f"weight sync: the transport did not consume every bucket of the plan for {self.plan.layout}"
                    )
        return SyncStats(time.perf_counter() - start, counted.bytes, counted.buckets, meter.peak)

    def conversion_errors(self) -> list[str]:
        """Collective: Megatron names whose conversion does not invert exactly (to localise a
        failed `verify.check_sync`), in plan order, on every rank."""
        return conversion_errors(self.plan, self._local(), self.groups)


@contextlib.contextmanager
def receiving(engine: LoadsWeights, plan: SyncPlan, timeout_s: float = 600.0) -> Iterator[None]:
    """Engine side of a sync over the sync group: pause, let the workers receive the plan's shards
    while the body runs (the trainer ranks send), wait for the load, resume. The engine flushes
    its prefix cache and bumps `weight_version` when the load completes."""
    engine.pause()
    try:
        loaded = engine.receive(CollectivePlan(plan))
        yield
        loaded.result(timeout=timeout_s)
    finally:
        engine.resume()


def sync_in_process(engine: LoadsWeights, sender: WeightSender) -> SyncStats:
    """A whole sync into an engine in this process, whose transport is `InProcessTransport(engine)`;
    trainer ranks without an engine call `sender.send()` alongside."""
    engine.pause()
    try:
        return sender.send()
    finally:
        engine.resume()
