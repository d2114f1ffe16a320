"""The scheduled ring sync: engines on the trainer's node whose layout differs from the trainer's
(train TP != rollout TP, or PP > 1 when colocated). Each engine worker reads one ring
(`ring_routes`, mode "scheduled"): colocated, worker r of engine k reads the ring of policy rank
`k * rollout_tp + r`, on its own device; split, worker r of every engine reads policy rank r's.
That ring carries the worker's own tensors in vLLM's per-rank layout, as the per-rank sync's do,
so the engine loads them with its per-rank loader (`receive(RankRings(...))`).

Every sending rank (DP replica 0's for the dense weights, the first expert-DP replica's for the experts,
which EP spreads over the DP replicas) sends, bucket by bucket, each piece of its own shards that the
planner's schedule (`schedule.build_schedule`) sends to worker r, to every rank hosting a worker r,
point to point inside the trainer world (gloo on CPU, NCCL on GPU: the trainer world never holds
two ranks of one device); a piece whose host is the sender itself is copied. Each hosting rank
assembles its worker's tensors of the bucket from the pieces it receives
(`shard_sync.bucket_inbox`, as a sync-group receiver does) and streams them through its own ring.
So each rank sends only what the workers need (`SyncSchedule.bytes_sent`), no rank gathers a full
tensor, and nothing goes through rank 0.

    transport = SharedMemoryTransport(readers=routes.readers[rank]) if routes.readers[rank] else None
    sender = ScheduledRingSender(plan, actor.named_parameters_for_sync, groups, routes, transport)
    ring = sender.begin()        # each sync (None: no ring here); the driver hands the rings along the routes
    stats = sender.send()        # collective over the trainer world; returns once the readers loaded

Memory per hosting rank: one bucket of its worker's tensors being assembled, the copies of its own
pieces of that bucket (a qkv part, a partial column block, another dtype), and the ring's two slots.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.bridge.collect import BufferMeter, local_params_by_plan_name, sync_rank
from megarl.bridge.plan import SyncPlan
from megarl.bridge.protocol import BucketMetadata
from megarl.bridge.ring_routes import RingRoutes
from megarl.bridge.schedule import BucketSchedule, build_schedule
from megarl.bridge.shard_sync import bucket_inbox, piece_tensors, shares_storage
from megarl.bridge.shared_ring import SharedRing
from megarl.bridge.sync import BucketCount, NamedParameters, SyncStats
from megarl.bridge.transports.shared_memory import SharedMemoryTransport
from megarl.models.layout import VOCAB_DIVISIBLE_BY
from megarl.parallel.distributed import ProcessGroups


class ScheduledRingSender:
    """The trainer side of the scheduled ring sync for one plan (built once, reused every step)."""

    def __init__(
        self,
        plan: SyncPlan,
        named_parameters: NamedParameters,
        groups: ProcessGroups,
        routes: RingRoutes,
        transport: SharedMemoryTransport | None,
        *,
        vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
    ):
        """`routes`: mode "scheduled"; `transport`: this rank's ring, of `routes.readers[rank]`
        readers, on the ranks that host a worker's ring; None elsewhere. `vocab_divisible_by`: the
        model's Megatron `make_vocab_size_divisible_by`."""
        if routes.mode != "scheduled":
            raise ValueError(f'ScheduledRingSender needs the "scheduled" ring routes, got {routes.mode!r}')
        layout = plan.layout
        self.schedule = build_schedule(plan, vocab_divisible_by)
        self.named_parameters, self.groups, self.transport = named_parameters, groups, transport
        self.rank = dist.get_rank()
        self.senders = routes.senders
        self.hosts = [sorted({workers[r][0] for workers in routes.sources}) for r in range(layout.rollout_tp)]
        """`hosts[r]`: the policy ranks whose rings workers r read (colocated: one per engine)."""
        hosted = [r for r, ranks in enumerate(self.hosts) if self.rank in ranks]
        if len(hosted) > 1 or bool(hosted) != (transport is not None):
            raise ValueError(
                f"scheduled ring sync: rank {self.rank} hosts the rings of workers {hosted} and was given "
                f"{'a' if transport else 'no'} transport; the routes give a rank one ring at most"
            )
        self.worker = hosted[0] if hosted else None
        """The TP rank of the engine workers reading this rank's ring (None: it hosts none)."""
        me = sync_rank(layout, groups)
        if me is not None and self.senders[me] != self.rank:
            raise ValueError(
                f"scheduled ring sync: this rank ({self.rank}) is schedule sender {me}, but the routes "
                f"name policy rank {self.senders[me]}"
            )
        self.sends = {
            tag: [piece for piece in bucket.pieces if piece.sender == me]
            for tag, bucket in enumerate(self.schedule.buckets)
        }
        """This rank's pieces of each bucket, in schedule order (none on a rank that sends nothing)."""
        # A bucket's batch_isend_irecv runs on the ranks it concerns only, which NCCL allows once the
        # group has had a collective of all its ranks (torch.distributed.batch_isend_irecv's docstring:
        # a first call of a subset is undefined). Every policy rank builds this sender: one barrier here.
        dist.barrier()

    def begin(self) -> SharedRing | None:
        """Open this rank's ring for the next sync; None on ranks that host none."""
        return None if self.transport is None else self.transport.begin()

    def send(self) -> SyncStats:
        """Collective over the trainer world: send this rank's pieces, assemble and stream its ring's
        workers'; returns once they have loaded them. `bytes_sent`: the bytes of this rank's pieces,
        each counted once per receiving host (itself included)."""
        start = time.perf_counter()
        meter, counted, sent = BufferMeter(), BucketCount(), [0]
        with torch.no_grad():
            local = local_params_by_plan_name(self.schedule.plan, self.named_parameters(), self.groups)
            device = next(iter(local.values())).device
            if self.transport is None:  # this rank only sends
                for tag, bucket in enumerate(self.schedule.buckets):
                    _, held, nbytes = self._exchange(tag, bucket, local, device)
                    meter.hold(held)
                    meter.release(held)
                    sent[0] += nbytes
            else:
                self.transport.send(counted.through(self._buckets(local, device, meter, sent)))
        peak = meter.peak + (0 if self.transport is None else self.transport.peak_shared_bytes)
        return SyncStats(time.perf_counter() - start, sent[0], counted.buckets, peak)

    def _buckets(
        self, local: dict[str, torch.Tensor], device: torch.device, meter: BufferMeter, sent: list[int]
    ) -> Iterator[tuple[torch.Tensor, BucketMetadata]]:
        """The tensors of this rank's ring's workers, bucket by bucket, each exchanged as the ring asks
        for it; `sent[0]` counts this rank's bytes."""
        for tag, bucket in enumerate(self.schedule.buckets):
            flat, held, nbytes = self._exchange(tag, bucket, local, device)
            sent[0] += nbytes
            meter.hold(held)
            yield flat, bucket.received[self.worker]
            del flat
            meter.release(held)

    def _exchange(
        self, tag: int, bucket: BucketSchedule, local: dict[str, torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor | None, int, int]:
        """One bucket: this rank's pieces to their hosts and its worker's pieces from their senders, in
        one batch (NCCL needs the sends and receives of a pair grouped, or two ranks sending each
        other first would wait forever); the worker's flat buffer, the bytes of buffers held and
        the bytes of this rank's pieces (no buffer: None, on ranks hosting no ring)."""
        destinations = []
        if self.worker is not None:
            inbox = bucket_inbox(bucket, self.worker, device)
            destinations = inbox.destinations
        ops, own, copies, sent = [], {}, 0, 0
        for piece, tensor in piece_tensors(self.schedule, self.sends[tag], local):
            if not shares_storage(tensor, local[piece.param.megatron_name]):
                copies += tensor.nbytes
            for host in self.hosts[piece.worker]:
                if host == self.rank:
                    own[piece] = tensor
                else:
                    ops.append(dist.P2POp(dist.isend, tensor, host, tag=tag))
                sent += tensor.nbytes
        for piece, destination in destinations:
            if piece not in own:
                ops.append(dist.P2POp(dist.irecv, destination, self.senders[piece.sender], tag=tag))
        works = dist.batch_isend_irecv(ops) if ops else []
        for piece, destination in destinations:
            if piece in own:
                destination.copy_(own[piece])
        for work in works:
            work.wait()
        if self.worker is None:
            return None, copies, sent
        return inbox.finish(), inbox.flat.nbytes + copies, sent
