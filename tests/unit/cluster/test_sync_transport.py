"""`rollout.sync.transport` resolved for a placement (`megarl.cluster.roles.sync_transport`): auto
takes CUDA IPC on colocated GPUs, shared memory where every engine worker's ring is on its node (on
CPU), else the collective; and the ring routes with `rollout.sync.per_rank` resolved (`shared_routes`)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from policy_grids import grids as policy_grids

from megarl.cluster.roles import shared_routes, sync_transport, weight_sync_grids
from megarl.config.loader import load_config
from megarl.orchestration.placement import PlacementError

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def test_auto_streams_through_shared_memory_when_every_engine_is_on_the_senders_node():
    assert sync_transport("auto", "cpu", False, ["node-a"], ["node-a", "node-a"]) == "shared_memory"


def test_auto_takes_cuda_ipc_on_colocated_gpus_and_the_collective_on_split_ones():
    assert sync_transport("auto", "cuda", True, ["node-a"], ["node-a", "node-b"]) == "cuda_ipc"
    assert sync_transport("auto", "cuda", False, ["node-a"], ["node-a", "node-a"]) == "collective"


def test_auto_falls_back_to_the_collective_for_split_engines_on_other_nodes():
    assert sync_transport("auto", "cpu", False, ["node-a"], ["node-a", "node-b"]) == "collective"


def test_colocated_engines_on_other_nodes_read_their_own_nodes_rings():
    # Each worker reads the ring of the trainer rank on its own bundle: a node of its own is no obstacle.
    assert sync_transport("auto", "cpu", True, ["node-a"], ["node-a", "node-b"]) == "shared_memory"
    assert sync_transport("shared_memory", "cpu", True, ["node-a"], ["node-b"]) == "shared_memory"


def test_split_rings_hosted_on_another_node_than_the_engines_fall_back_to_the_collective():
    # The scheduled split rings are on ranks 0 .. rollout TP - 1: all must share the engines' node.
    assert sync_transport("auto", "cpu", False, ["node-a", "node-b"], ["node-a"]) == "collective"


def test_an_explicit_choice_is_kept_where_it_can_run():
    assert sync_transport("collective", "cpu", False, ["node-a"], ["node-a"]) == "collective"
    assert sync_transport("shared_memory", "cpu", False, ["node-a"], ["node-a"]) == "shared_memory"


def test_split_shared_memory_with_an_engine_on_another_node_names_the_setting_and_the_fix():
    with pytest.raises(PlacementError, match=r"rollout.sync.transport=shared_memory.*2 nodes.*collective"):
        sync_transport("shared_memory", "cpu", False, ["node-a"], ["node-a", "node-b", "node-b"])


def _routes(*overrides: str, grids=None, engines: int = 2, colocated: bool = True):
    config = load_config(QUICKSTART, list(overrides))
    plan = SimpleNamespace(rollout_engines=engines, colocated=colocated)
    return shared_routes(config, plan, grids or policy_grids(tp=1, pp=1, dp=2))


TP_1 = "actor.parallel.tensor_model_parallel_size=1"


def test_auto_routes_per_rank_when_the_tp_sizes_match_on_the_vllm_backend():
    assert _routes(TP_1).mode == "per_rank"
    assert _routes(TP_1, "rollout.backend=hf").mode == "every_rank"
    assert _routes(TP_1, "rollout.sync.per_rank=never").mode == "every_rank"


def test_auto_sends_the_schedules_pieces_when_the_tp_sizes_differ():
    assert _routes(grids=policy_grids(tp=2, pp=1, dp=1)).mode == "scheduled"
    assert _routes("rollout.backend=hf", grids=policy_grids(tp=2, pp=1, dp=1)).mode == "every_rank"


def test_split_experts_go_through_the_rings_as_the_schedules_pieces_where_vllm_loads_them_per_rank():
    """Actor EP 2 on two ranks (TP 1): the rings carry the schedule's pieces from both ranks (rank 1 holds half
    the experts) even at equal TP; without the per-rank load (the HF engine) only the collective carries them,
    and auto takes it (`collective_only`), on CPU and on colocated GPUs alike."""
    ep = ("actor.parallel.expert_model_parallel_size=2", TP_1)
    routes = _routes(*ep, grids=policy_grids(tp=1, pp=1, dp=2, stage_senders=2))
    assert (routes.mode, routes.senders) == ("scheduled", (0, 1))
    assert sync_transport("auto", "cpu", True, ["node-a"], ["node-a"]) == "shared_memory"
    assert sync_transport("auto", "cuda", True, ["node-a"], ["node-a"]) == "cuda_ipc"
    assert sync_transport("auto", "cuda", True, ["node-a"], ["node-a"], collective_only=True) == "collective"


def test_per_rank_always_where_the_routes_do_not_stream_own_shards_names_the_setting_and_the_fix():
    with pytest.raises(PlacementError, match=r"rollout.sync.per_rank=always.*scheduled.*PP 2.*per_rank: auto"):
        _routes(
            TP_1,
            "actor.parallel.pipeline_model_parallel_size=2",
            "rollout.sync.per_rank=always",
            grids=policy_grids(tp=1, pp=2, dp=1),
        )


def test_train_refuses_the_collective_on_colocated_gpus_once_the_cluster_has_them():
    from megarl.config.placement import cluster_problems, placement_problems

    config = load_config(
        QUICKSTART, ["trainer.device=auto", "rollout.sync.transport=collective"]
    )  # the quickstart is colocated
    assert placement_problems(config, "auto") == []  # validate: it may still run on CPU
    assert cluster_problems(config, cluster_gpus=0) == []
    [problem] = cluster_problems(config, cluster_gpus=2)
    assert (problem.key, problem.value) == ("rollout.sync.transport", "collective")
    assert "NCCL refuses two ranks on one device" in problem.why and "auto" in problem.fix


def test_only_cp_rank_0_of_dp_replica_0_fills_the_split_engines_rings_under_context_parallelism():
    """TP 1 × CP 2 × DP 1, split engines: both ranks are DP rank 0 and hold the same weights; the weight sync's view
    of the grid (`weight_sync_grids`, from `PolicyWorker.grid`'s `sync_replica`) has CP rank 0 alone fill the
    rings. The grid itself would read the two CP ranks as two ranks of one replica."""
    grids = [
        dict(rank=rank, tp_rank=0, pp_rank=0, dp_rank=0, dp_size=1, sync_replica=rank, sync_sender=(0, None)[rank])
        for rank in range(2)
    ]
    routes = _routes(TP_1, grids=weight_sync_grids(grids), colocated=False)
    assert (routes.mode, routes.readers, routes.sources) == ("per_rank", (2, 0), (((0,),), ((0,),)))
    assert _routes(TP_1, grids=grids, colocated=False).sources == (((0, 1),), ((0, 1),))
