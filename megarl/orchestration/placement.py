"""Placement groups: one bundle per rank process, GPU bundles on GPU clusters, CPU bundles here."""

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group


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


def create_placement_group(
    name: str, n_processes: int, bundle: BundleSpec, timeout_s: float = 120.0
) -> PlacementGroup:
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


def engine_bundles(pg: PlacementGroup, first_bundle: int, engines: int, tp: int, gpus_per_node: int) -> list[list[int]]:
    """The bundle indices of each rollout engine: engine k spans the `tp` bundles first_bundle + k·tp ...
    (its TP workers, one per device). Raises `PlacementError` when Ray put an engine's bundles on several
    nodes: vLLM's TP workers of one engine must share a node."""
    bundles = [[first_bundle + engine * tp + rank for rank in range(tp)] for engine in range(engines)]
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
