"""Placement groups: one bundle per rank process, GPU bundles on GPU clusters, CPU bundles here.

Slots. Ray hands each GPU bundle a GPU id in no promised order, and vLLM's Ray executor puts an
engine's TP rank r on the r-th lowest GPU id of its workers' node, whatever bundle the worker sits on
(`vllm/v1/executor/ray_executor.py: RayDistributedExecutor._init_workers_ray`: the workers, in
`VLLM_RAY_BUNDLE_INDICES` order on one node, get local rank r and `assigned_physical_gpu_ids` sorted).
So a run addresses its bundles through slots (`gpu_slots`): slot i is the bundle of the i-th lowest
GPU id among the bundles of slot i's node, and consecutive slots of one node name ascending GPUs. An
engine on consecutive slots then computes on the GPUs of its bundles, each TP rank on the GPU of the
trainer rank of the same slot, whatever order Ray handed the GPUs out in.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The cluster cannot host the requested processes."""


@dataclass(frozen=True)
class BundleSpec:
    """The resources of one rank process."""

    cpus: float = 1.0
    """CPU cores reserved per process."""
    gpus: float = 0.0
    """GPUs per process: 1 on GPU clusters, 0 on CPU."""

    def as_bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus}
        if self.gpus:
            bundle["GPU"] = self.gpus
        return bundle


def create_placement_group(name: str, n_processes: int, bundle: BundleSpec, timeout_s: float = 120.0) -> PlacementGroup:
    """Reserve `n_processes` bundles (packed onto as few nodes as possible) or fail with what is missing."""
    pg = placement_group([bundle.as_bundle()] * n_processes, strategy="PACK", name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"placement group '{name}' needs {n_processes} processes × ({_describe(bundle.as_bundle())}) "
            f"within {timeout_s:.0f} s, but the Ray cluster has {_describe(ray.cluster_resources())} "
            f"({_describe(ray.available_resources())} free); lower placement.nnodes × placement.gpus_per_node "
            "or add nodes"
        )
    return pg


GPU_PROBE_SHARE = 0.01
"""The GPU share of `gpu_slots`' probe task: any share of a bundle runs on the bundle's one GPU."""


def slot_order(nodes: Sequence[str], gpu_ids: Sequence[int]) -> list[int]:
    """Slot -> bundle (module docstring), given each bundle's node and GPU id (`gpu_ids[b]`, the physical
    index): the slots a node's bundles hold stay that node's, refilled with its bundles by ascending GPU id.

        slot_order(["a", "a", "b", "b"], [1, 0, 0, 1])  ->  [1, 0, 2, 3]
    """
    slots = list(range(len(nodes)))
    for node in dict.fromkeys(nodes):
        held = [bundle for bundle in range(len(nodes)) if nodes[bundle] == node]
        for slot, bundle in zip(held, sorted(held, key=lambda b: gpu_ids[b])):
            slots[slot] = bundle
    return slots


def gpu_slots(pg: PlacementGroup, count: int) -> list[int]:
    """`slot_order` of the first `count` GPU bundles of `pg`: each bundle's GPU id read by a task
    placed on it (the id Ray gives every process of that bundle). Ids that are not indices (GPU UUIDs in
    CUDA_VISIBLE_DEVICES, which vLLM orders by NVML's index) leave the bundles in their order, as before
    slots existed: the CUDA IPC sync's device check then stops a run whose pairs Ray crossed."""
    probe = ray.remote(num_cpus=0, num_gpus=GPU_PROBE_SHARE)(_gpu_id)
    strategy = [
        PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b) for b in range(count)
    ]
    gpu_ids = ray.get([probe.options(scheduling_strategy=s).remote() for s in strategy])
    if not all(gpu.isdigit() for gpu in gpu_ids):
        logger.warning(
            "Ray's GPU ids %s are not indices: the placement keeps the bundles' order (list the GPUs "
            "by index in CUDA_VISIBLE_DEVICES so that each engine's TP ranks pair with their GPUs)",
            gpu_ids,
        )
        return list(range(count))
    node_of = placement_group_table(pg)["bundles_to_node_id"]
    return slot_order([node_of[b] for b in range(count)], [int(gpu) for gpu in gpu_ids])


def _gpu_id() -> str:
    """This task's GPU id as Ray gives it (an index, the physical index vLLM sorts by, or a UUID)."""
    [gpu] = ray.get_gpu_ids()
    return str(gpu)


def engine_bundles(
    pg: PlacementGroup, slots: Sequence[int], first_slot: int, engines: int, tp: int, gpus_per_node: int
) -> list[list[int]]:
    """The bundle indices of each rollout engine: engine k spans the `tp` slots first_slot + k·tp ...
    (its TP workers, one per device; `slots`: slot -> bundle, `gpu_slots`). Raises `PlacementError` when
    Ray put an engine's bundles on several nodes: vLLM's TP workers of one engine must share a node."""
    bundles = [[slots[first_slot + engine * tp + rank] for rank in range(tp)] for engine in range(engines)]
    node_of = placement_group_table(pg)["bundles_to_node_id"]
    for engine, indices in enumerate(bundles):
        nodes = {node_of[index] for index in indices}
        if len(nodes) > 1:
            raise PlacementError(
                f"rollout engine {engine} would span bundles {indices} on {len(nodes)} nodes: "
                f"rollout.tensor_model_parallel_size={tp} must fit in one node of placement.gpus_per_node="
                f"{gpus_per_node} GPUs; use a rollout TP that divides the GPUs of every node"
            )
    return bundles


def _describe(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(key, 0):g} {key}" for key in ("CPU", "GPU"))
