"""`route_rings`: which trainer rank's ring each engine worker reads (`megarl.bridge.ring_routes`).
Colocated, every worker reads only the ring of the policy rank on its own device bundle (so a CUDA
IPC handle is never opened on another GPU), and with other layouts than the per-rank one the
schedule's senders are DP replica 0's ranks; split, the rings of DP replica 0 or rank 0's."""

import pytest
from policy_grids import grids

from megarl.bridge.ring_routes import route_rings

pytestmark = pytest.mark.unit


def device_of_worker(engine: int, tp_rank: int, rollout_tp: int) -> int:
    """Colocated: engine k's worker r sits on bundle k * TP + r (the rollout group starts at bundle 0)."""
    return engine * rollout_tp + tp_rank


@pytest.mark.parametrize(
    "tp, pp, dp, rollout_tp, mode",
    [
        (2, 1, 2, 2, "per_rank"),  # TP matches, PP 1: each rank's own shards
        (1, 1, 4, 1, "per_rank"),
        (2, 1, 2, 1, "scheduled"),  # TP differs: the planner's pieces, assembled on the worker's rank
        (1, 2, 2, 2, "scheduled"),  # PP 2: a rank holds one stage only
        (2, 2, 1, 2, "scheduled"),  # TP matches but PP 2
    ],
)
def test_colocated_workers_read_only_the_ring_on_their_own_device(tp, pp, dp, rollout_tp, mode):
    world = tp * pp * dp
    engines = world // rollout_tp
    routes = route_rings(grids(tp, pp, dp), engines, rollout_tp, colocated=True, per_rank=True, experts_split=False)
    assert routes.mode == mode
    assert routes.readers == (1,) * world  # one ring per device, one reader each
    for engine in range(engines):
        for tp_rank in range(rollout_tp):
            assert routes.sources[engine][tp_rank] == (device_of_worker(engine, tp_rank, rollout_tp),)


def test_colocated_per_rank_pairs_a_worker_with_the_trainer_rank_of_its_tp_rank():
    layout = grids(tp=2, pp=1, dp=2)
    routes = route_rings(layout, engines=2, rollout_tp=2, colocated=True, per_rank=True, experts_split=False)
    for engine, workers in enumerate(routes.sources):
        for tp_rank, (rank,) in enumerate(workers):
            assert (layout[rank]["tp_rank"], layout[rank]["dp_rank"]) == (tp_rank, engine)


def test_per_rank_off_gathers_even_when_the_layouts_match():
    assert route_rings(grids(2, 1, 2), 2, 2, colocated=True, per_rank=False, experts_split=False).mode == "every_rank"
    assert route_rings(grids(2, 1, 2), 4, 1, colocated=True, per_rank=False, experts_split=False).mode == "every_rank"


@pytest.mark.parametrize("tp, pp, dp", [(2, 1, 2), (1, 2, 2), (2, 2, 1)])
def test_scheduled_senders_are_dp_replica_0s_ranks_in_the_schedules_order(tp, pp, dp):
    layout = grids(tp, pp, dp)
    routes = route_rings(layout, engines=tp * pp * dp, rollout_tp=1, colocated=True, per_rank=True, experts_split=False)
    assert routes.mode == "scheduled"
    # Schedule sender i (`plan.sender_rank`) is stage i // tp, TP rank i % tp, of DP replica 0.
    assert [(layout[rank]["pp_rank"], layout[rank]["tp_rank"], layout[rank]["dp_rank"]) for rank in routes.senders] == [
        (*divmod(sender, tp), 0) for sender in range(tp * pp)
    ]


def test_engine_rings_hands_each_engine_its_workers_rings():
    routes = route_rings(grids(2, 1, 2), 2, 2, colocated=True, per_rank=True, experts_split=False)
    rings = ["ring 0", "ring 1", "ring 2", "ring 3"]
    assert routes.engine_rings(1, rings) == {0: ["ring 2"], 1: ["ring 3"]}


def test_split_per_rank_reads_dp_replica_0s_stages_in_stage_order():
    layout = grids(tp=2, pp=2, dp=2)  # ranks: stage 0 = 0..3, stage 1 = 4..7; DP 0 = tp ranks of dp 0
    routes = route_rings(layout, engines=3, rollout_tp=2, colocated=False, per_rank=True, experts_split=False)
    assert routes.mode == "per_rank"
    assert routes.sources == (((0, 4), (1, 5)),) * 3
    assert routes.readers == (3, 3, 0, 0, 3, 3, 0, 0)


def test_split_scheduled_worker_r_of_every_engine_reads_rank_rs_ring():
    layout = grids(tp=1, pp=2, dp=2)  # 4 ranks; 3 engines of rollout TP 2
    routes = route_rings(layout, engines=3, rollout_tp=2, colocated=False, per_rank=True, experts_split=False)
    assert routes.mode == "scheduled"
    assert routes.sources == (((0,), (1,)),) * 3
    assert routes.readers == (3, 3, 0, 0)
    assert routes.senders == (0, 2)  # stage 0 and stage 1 of DP replica 0


def test_split_gathered_is_rank_0s_ring_read_by_every_worker():
    # The per-rank load off (HF backend, per_rank: never), or more workers per engine than ranks.
    for tp, rollout_tp, per_rank in ((2, 1, False), (1, 2, True)):
        routes = route_rings(
            grids(tp=tp, pp=1, dp=1),
            engines=2,
            rollout_tp=rollout_tp,
            colocated=False,
            per_rank=per_rank,
            experts_split=False,
        )
        assert routes.mode == "rank0"
        assert routes.sources == ((((0,),) * rollout_tp),) * 2
        assert routes.readers == (2 * rollout_tp,) + (0,) * (tp - 1)


def test_colocated_counts_that_do_not_pair_workers_with_ranks_are_refused():
    with pytest.raises(ValueError, match=r"3 engines × rollout TP 1 = 3 workers for 4 policy ranks"):
        route_rings(grids(2, 1, 2), engines=3, rollout_tp=1, colocated=True, per_rank=True, experts_split=False)


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "split"])
def test_split_experts_take_the_schedules_pieces_from_every_rank_holding_some(colocated):
    """TP 1 × DP 2 with EP 2: rank 1 sends no dense weights but half the experts, so it is the schedule's
    sender 1, and a rank's own shards (its experts only) are no worker's: "scheduled" even at equal TP."""
    layout = grids(tp=1, pp=2, dp=2, stage_senders=2)
    routes = route_rings(
        layout, engines=4 if colocated else 2, rollout_tp=1, colocated=colocated, per_rank=True, experts_split=True
    )
    assert routes.mode == "scheduled"
    assert routes.senders == (0, 1, 2, 3)  # every rank: stage 0's two EP ranks, then stage 1's
    with pytest.raises(ValueError, match="only the per-rank load of the schedule's pieces carries"):
        route_rings(layout, engines=4, rollout_tp=1, colocated=True, per_rank=False, experts_split=True)
