"""Where `roles.start_rollout` puts the engines (issue 15, item 4): engine k on the rollout TP bundles
`placement.engine_bundles` gives it, its actor on the first of them, its vLLM workers placed by the
`VLLM_RAY_*` environment with the GPU share of one process of the bundle; and an engine whose bundles
Ray put on two nodes is refused, naming the setting. Whatever order Ray hands GPU ids to the bundles in,
each engine TP rank computes on the GPU of the trainer rank it pairs with (issue 32, item 4: the run's
slots, `placement.slot_order`). No processes: the worker group is a recording stand-in and the
placement group's bundle-to-node table is given (Ray's real placement is
`tests/e2e/orchestration/test_rollout_placement.py`)."""

import itertools

import pytest

from megarl.cluster import roles
from megarl.config.batch_plan import plan_batches
from megarl.config.loader import build_config
from megarl.orchestration import placement
from megarl.orchestration.placement import PlacementError, engine_bundles


def config_of(data: dict):
    problems = []
    config = build_config(data, problems)
    assert problems == []
    return config


SEEDS = {
    "data": {"train_batch_size": 12},
    "rollout": {"n": 8, "tensor_model_parallel_size": 2},
    "actor": {"ppo_mini_batch_size": 12, "micro_batch_size_per_gpu": 8},
    "placement": {"gpus_per_node": 6},
}
"""The seeds' layout: 6 GPUs, colocated, rollout TP 2."""
SPLIT = {
    **SEEDS,
    "placement": {"mode": "split", "nnodes": 2, "gpus_per_node": 4, "rollout_gpus": 4},
    "actor": {"ppo_mini_batch_size": 12, "micro_batch_size_per_gpu": 8},
}
"""2 nodes × 4 GPUs: the first node trains, the second hosts two TP-2 engines."""


@pytest.fixture
def nodes(monkeypatch):
    """Bundle i of the placement group lies on node i // per_node (Ray's PACK on equal bundles)."""

    def place(per_node: int, bundles: int = 16) -> None:
        table = {"bundles_to_node_id": {i: f"node-{i // per_node}" for i in range(bundles)}}
        monkeypatch.setattr(placement, "placement_group_table", lambda pg: table)

    return place


class RecordingGroup:
    """Stands in for `WorkerGroup`: keeps its arguments."""

    def __init__(self, role, target, world_size, pg, bundle, init_kwargs, env, hang_timeout_s, bundles):
        self.__dict__.update(locals())


def started(data: dict, gpus_per_device: float, monkeypatch, slots: list[int] | None = None) -> RecordingGroup:
    monkeypatch.setattr(roles, "WorkerGroup", RecordingGroup)
    config = config_of(data)
    return roles.start_rollout(
        config, plan_batches(config), "pg", slots or list(range(16)), gpus_per_device, {"MEGARL_DEVICE": "cuda"}, False
    )


def test_the_seeds_three_engines_span_two_bundles_each(nodes, monkeypatch):
    nodes(per_node=6)
    group = started(SEEDS, gpus_per_device=0.5, monkeypatch=monkeypatch)
    assert (group.world_size, group.bundles) == (3, [0, 2, 4])
    assert group.bundle.gpus == 0.0  # the engine's GPUs belong to its vLLM workers
    assert group.init_kwargs["args"].enforce_eager is False  # the run's resolved `rollout.enforce_eager`
    assert [env["VLLM_RAY_BUNDLE_INDICES"] for env in group.env] == ["0,1", "2,3", "4,5"]
    assert {env["VLLM_RAY_PER_WORKER_GPUS"] for env in group.env} == {"0.5"}
    assert all(env["MEGARL_DEVICE"] == "cuda" for env in group.env)
    assert group.init_kwargs["args"].tensor_parallel_size == 2


def test_split_engines_take_the_bundles_after_the_trainer(nodes, monkeypatch):
    nodes(per_node=4)
    group = started(SPLIT, gpus_per_device=1.0, monkeypatch=monkeypatch)
    assert (group.world_size, group.bundles) == (2, [4, 6])
    assert [env["VLLM_RAY_BUNDLE_INDICES"] for env in group.env] == ["4,5", "6,7"]
    assert {env["VLLM_RAY_PER_WORKER_GPUS"] for env in group.env} == {"1.0"}


def test_a_tp_1_engine_holds_its_share_itself(nodes, monkeypatch):
    nodes(per_node=6)
    tp1 = {**SEEDS, "rollout": {"n": 8, "tensor_model_parallel_size": 1}}
    group = started(tp1, gpus_per_device=0.5, monkeypatch=monkeypatch)
    assert (group.world_size, group.bundles, group.bundle.gpus) == (6, [0, 1, 2, 3, 4, 5], 0.5)


def test_an_engine_on_two_nodes_is_refused_naming_the_setting(nodes):
    nodes(per_node=3)  # Ray put bundles 0-2 on one node and 3-5 on another
    with pytest.raises(PlacementError) as error:
        engine_bundles("pg", list(range(6)), first_slot=0, engines=3, tp=2, gpus_per_node=6)
    assert str(error.value) == (
        "rollout engine 1 would span bundles [2, 3] on 2 nodes: rollout.tensor_model_parallel_size=2 must fit in "
        "one node of placement.gpus_per_node=6 GPUs; use a rollout TP that divides the GPUs of every node"
    )


def test_engines_take_the_bundles_of_their_slots(nodes, monkeypatch):
    nodes(per_node=6)
    group = started(SEEDS, gpus_per_device=0.5, monkeypatch=monkeypatch, slots=[1, 0, 3, 2, 5, 4])
    assert group.bundles == [1, 3, 5]
    assert [env["VLLM_RAY_BUNDLE_INDICES"] for env in group.env] == ["1,0", "3,2", "5,4"]


def vllm_tp_gpus(bundle_indices: list[int], gpu_of: dict[int, int]) -> list[int]:
    """The GPU each TP rank of one engine on one node computes on, by vLLM's rule
    (vllm/v1/executor/ray_executor.py: RayDistributedExecutor._init_workers_ray): the worker created on
    `bundle_indices[r]` keeps rank r (the sort by node is stable on one node), gets local rank r and
    the node's worker GPU ids sorted as `assigned_physical_gpu_ids`, and uses the r-th of those."""
    return [sorted(gpu_of[b] for b in bundle_indices)[rank] for rank in range(len(bundle_indices))]


@pytest.mark.parametrize("nodes_of", [["n0"] * 4, ["n0", "n0", "n1", "n1"]], ids=["one-node", "two-nodes"])
def test_every_tp_rank_computes_on_the_gpu_of_its_trainer_rank_whatever_ids_ray_gave(nodes_of):
    tp = 2
    for ids in itertools.permutations(range(4)):
        gpu_of = dict(enumerate(ids))  # bundle -> the GPU id Ray gave it (ids repeat across nodes in reality)
        slots = placement.slot_order(nodes_of, ids)
        assert sorted(slots) == [0, 1, 2, 3] and all(nodes_of[slots[s]] == nodes_of[s] for s in range(4))
        for engine in range(len(slots) // tp):
            indices = [slots[engine * tp + rank] for rank in range(tp)]
            if len({nodes_of[b] for b in indices}) > 1:
                continue  # engine_bundles refuses it
            trainer_gpus = [gpu_of[slots[engine * tp + rank]] for rank in range(tp)]
            assert vllm_tp_gpus(indices, gpu_of) == trainer_gpus, (ids, slots)


def test_without_slots_an_engine_would_compute_on_another_ranks_gpu():
    gpu_of = {0: 1, 1: 0}  # Ray gave bundle 0 GPU 1
    assert vllm_tp_gpus([0, 1], gpu_of) != [gpu_of[0], gpu_of[1]]
    assert placement.slot_order(["n0", "n0"], [1, 0]) == [1, 0]


class _Probe:
    """Stands in for `ray.remote(...)(_gpu_id)`: each bundle's task answers the next id."""

    def __init__(self, ids):
        self.ids = iter(ids)

    def options(self, scheduling_strategy):
        return self

    def remote(self):
        return next(self.ids)


@pytest.mark.parametrize(
    "ids, slots",
    [(["1", "0", "3", "2"], [1, 0, 3, 2]), (["GPU-b", "GPU-a", "GPU-d", "GPU-c"], [0, 1, 2, 3])],
    ids=["indices", "uuids-keep-bundle-order"],
)
def test_gpu_slots_order_by_index_and_keep_bundle_order_for_uuids(nodes, monkeypatch, ids, slots):
    nodes(per_node=4)
    monkeypatch.setattr(placement.ray, "remote", lambda **resources: lambda function: _Probe(ids))
    monkeypatch.setattr(placement.ray, "get", lambda refs: list(refs))
    monkeypatch.setattr(placement, "PlacementGroupSchedulingStrategy", lambda **kwargs: kwargs)
    assert placement.gpu_slots("pg", 4) == slots
