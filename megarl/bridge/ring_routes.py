"""Which trainer rank's ring each engine worker reads, for the shared transports (shared memory on
CPU, CUDA IPC on GPU): pure, decided once per run from the layouts and the placement.

Colocated, engine worker r of engine k sits on device bundle `k * rollout_tp + r`, the bundle of
policy rank `k * rollout_tp + r`, and reads only that rank's ring: on GPU a CUDA IPC handle is
then always opened on the GPU that holds it, never on another (a foreign handle). Every rank hosts
a ring of one reader:

- "per_rank" (train TP == rollout TP, PP 1): the rank's own shards, already in vLLM worker r's
  layout (`per_rank.PerRankSender`); policy rank `k * tp + r` is TP rank r of DP replica k.
- "scheduled" (any other layout, and any layout whose experts lie otherwise than the dense weights: EP,
  expert TP ≠ TP, vLLM expert parallelism): the rank's worker's tensors in vLLM's per-rank layout too,
  assembled from the pieces the planner's schedule sends it (`schedule.build_schedule`): each sending
  rank (DP replica 0's for the dense weights, the first expert-DP replica's for the experts; the
  schedule's sender i is policy rank `senders[i]`) sends each piece point to point, inside the trainer
  world, to the ranks hosting the piece's worker (`scheduled_ring.ScheduledRingSender`); nothing is
  gathered.
- "every_rank" (the per-rank load not allowed: `rollout.sync.per_rank: never`, or an engine
  backend that loads only full HF tensors): the gathered HF buckets, which every rank assembles
  (`sync.WeightSender(every_rank=True)`).

Split (engines on their own bundles, same node: CPU shared memory only, since CUDA IPC needs the
engine on the sender's GPU):

- "per_rank" (train TP == rollout TP): worker r of every engine reads the rings of TP rank r of
  DP replica 0, one per stage in stage order; each of those rings has one reader per engine.
- "scheduled" (any other layout, rollout TP <= the policy ranks): worker r of every engine reads
  the ring of policy rank r, which assembles worker r's tensors from the schedule's pieces as
  colocated; the ranks from rollout TP on only send.
- "rank0" (the per-rank load not allowed, or more workers per engine than policy ranks): rank 0
  alone assembles the gathered buckets; every worker of every engine reads its ring.

    routes = route_rings(grids, engines=4, rollout_tp=2, colocated=True, per_rank=True, experts_split=False)
    routes.readers[rank]                  # workers reading policy rank `rank`'s ring (0: it has none)
    routes.engine_rings(k, rings)         # {tp_rank: [ring, ...]} for engine k, from every rank's ring
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Mode = Literal["per_rank", "scheduled", "every_rank", "rank0"]


@dataclass(frozen=True)
class RingRoutes:
    """The shared-transport routes of one run."""

    mode: Mode
    """What the rings carry and who fills them (module docstring)."""
    readers: tuple[int, ...]
    """Per policy rank: the engine workers reading its ring; 0 where the rank hosts no ring."""
    sources: tuple[tuple[tuple[int, ...], ...], ...]
    """`sources[k][r]`: the policy ranks whose rings worker r of engine k reads, in stage order."""
    senders: tuple[int, ...] = ()
    """"scheduled": the policy rank of the schedule's sender i (`schedule.sender_rank`, the grids'
    `sync_sender`); empty otherwise."""

    @property
    def per_rank(self) -> bool:
        """The rings carry each rank's own shards in vLLM's per-rank layout (not gathered buckets)."""
        return self.mode == "per_rank"

    @property
    def rank_layout(self) -> bool:
        """The rings carry vLLM per-rank tensors (the engines load them as `RankRings`), not
        full HF tensors."""
        return self.mode in ("per_rank", "scheduled")

    def engine_rings(self, engine: int, rings: Sequence) -> dict[int, list]:
        """`{tp_rank: [ring, ...]}` for `engine`, from every policy rank's ring (in rank order)."""
        return {tp_rank: [rings[rank] for rank in ranks] for tp_rank, ranks in enumerate(self.sources[engine])}


def route_rings(
    grids: Sequence[dict[str, int | None]],
    engines: int,
    rollout_tp: int,
    *,
    colocated: bool,
    per_rank: bool,
    experts_split: bool,
) -> RingRoutes:
    """The routes for the actor's `grids` (per policy rank: its `tp_rank`, `pp_rank`, `dp_rank` and
    `sync_sender`, its sender index in the sync's schedule or None: `PolicyWorker.grid`) and `engines`
    engines of `rollout_tp`; `per_rank`: the per-rank load is allowed (`rollout.sync.per_rank` not
    "never", vLLM backend); `experts_split`: a rank's own shards are not a worker's
    (`LayoutPair.experts_split`), so only the schedule's pieces reach the workers. Raises ValueError for a
    colocated layout whose bundles do not pair one engine worker with one policy rank, or experts split
    without the per-rank load (the gathered buckets do not carry them)."""
    if experts_split and not per_rank:
        raise ValueError(
            "ring routes: the experts are split, which only the per-rank load of the schedule's pieces carries, "
            "and the per-rank load is not allowed here (rollout.sync.per_rank: never, or an engine that loads "
            "only whole HF tensors)"
        )
    train_tp, train_pp = (1 + max(grid[key] for grid in grids) for key in ("tp_rank", "pp_rank"))
    same_tp = per_rank and train_tp == rollout_tp and not experts_split
    if colocated:
        if len(grids) != engines * rollout_tp:
            raise ValueError(
                f"colocated ring routes: {engines} engines × rollout TP {rollout_tp} = {engines * rollout_tp} workers "
                f"for {len(grids)} policy ranks; each worker reads the ring of the rank on its own device, so the "
                "counts must be equal"
            )
        sources = tuple(tuple((k * rollout_tp + r,) for r in range(rollout_tp)) for k in range(engines))
        if same_tp and train_pp == 1:
            _check_tp_ranks(grids, rollout_tp)
            return RingRoutes("per_rank", (1,) * len(grids), sources)
        if per_rank:
            return RingRoutes("scheduled", (1,) * len(grids), sources, _schedule_senders(grids))
        return RingRoutes("every_rank", (1,) * len(grids), sources)
    if same_tp:
        by_tp = [
            tuple(
                sorted(
                    (rank for rank, g in enumerate(grids) if g["dp_rank"] == 0 and g["tp_rank"] == r),
                    key=lambda rank: grids[rank]["pp_rank"],
                )
            )
            for r in range(rollout_tp)
        ]
        readers = tuple(engines if g["dp_rank"] == 0 else 0 for g in grids)
        return RingRoutes("per_rank", readers, (tuple(by_tp),) * engines)
    if per_rank and rollout_tp <= len(grids):
        readers = tuple(engines if rank < rollout_tp else 0 for rank in range(len(grids)))
        sources = (tuple((r,) for r in range(rollout_tp)),) * engines
        return RingRoutes("scheduled", readers, sources, _schedule_senders(grids))
    readers = (engines * rollout_tp,) + (0,) * (len(grids) - 1)
    return RingRoutes("rank0", readers, (((0,),) * rollout_tp,) * engines)


def _schedule_senders(grids: Sequence[dict[str, int | None]]) -> tuple[int, ...]:
    """Per schedule sender (`schedule.sender_rank`), the policy rank that is that sender (its grid's
    `sync_sender`)."""
    at = {grid["sync_sender"]: rank for rank, grid in enumerate(grids) if grid["sync_sender"] is not None}
    if sorted(at) != list(range(len(at))):
        raise ValueError(f"ring routes: the policy ranks' sync senders {sorted(at)} are not 0..{len(at) - 1}")
    return tuple(at[sender] for sender in range(len(at)))


def _check_tp_ranks(grids: Sequence[dict[str, int]], rollout_tp: int) -> None:
    """Policy rank `k * tp + r` must be TP rank r (megatron-core orders TP fastest), or worker r would
    get another rank's shards."""
    for rank, grid in enumerate(grids):
        if grid["tp_rank"] != rank % rollout_tp:
            raise ValueError(
                f"colocated per-rank ring routes: policy rank {rank} is TP rank {grid['tp_rank']}, but the engine "
                f"worker on its device is TP rank {rank % rollout_tp}"
            )
