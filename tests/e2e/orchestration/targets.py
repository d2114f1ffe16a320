"""Plain worker classes hosted by the worker-group tests (imported inside Ray actor processes)."""

import os
import time

import torch
import torch.distributed as dist

from megarl.workers.rollout.engine_args import EngineArgs


class SumWorker:
    """All-reduces a value over the group: proves the ranks form one torch.distributed world."""

    def __init__(self, offset: int = 0, shutdown_marker: str | None = None):
        self.offset = offset
        self.shutdown_marker = shutdown_marker

    def shutdown(self) -> None:
        """The clean-up `WorkerGroup.shutdown` runs: leaves `<shutdown_marker>.<rank>` behind."""
        open(f"{self.shutdown_marker}.{dist.get_rank()}", "w").close()

    def all_reduce(self, value: float) -> float:
        t = torch.tensor([value + self.offset], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    def checksum(self, values: list) -> float:
        """A shared argument as this rank received it, summed (and its rank, to tell the replies apart)."""
        return float(sum(values)) + 1000 * torch.distributed.get_rank()

    def rank(self) -> int:
        return dist.get_rank()

    def fail_on(self, rank: int) -> None:
        if dist.get_rank() == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        dist.barrier()  # the other ranks block here until the group is killed

    def die_on(self, rank: int) -> None:
        if dist.get_rank() == rank:
            os._exit(1)
        dist.barrier()

    def hang(self) -> None:
        time.sleep(3600)

    def die_after(self, delay_s: float) -> None:
        time.sleep(delay_s)
        os._exit(1)


class DeviceProbe:
    """Reports what a rank process was given: its Ray GPU ids, CUDA_VISIBLE_DEVICES and the device index
    the worker group computed (LOCAL_RANK), on a gloo world (no CUDA is touched)."""

    def report(self) -> dict:
        import ray

        return {
            "rank": dist.get_rank(),
            "backend": dist.get_backend(),
            "gpu_ids": sorted(str(gpu) for gpu in ray.get_gpu_ids()),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_index": int(os.environ["LOCAL_RANK"]),
            "node": ray.get_runtime_context().get_node_id(),
        }


def placement_report() -> dict:
    """Where this Ray actor runs: the placement-group bundles it draws from (Ray names a bundle's
    resources `<resource>_group_<bundle>_<group id>`: ray/_private/utils.py, the names
    `get_assigned_resources` folds back), its GPU ids and node."""
    import re

    import ray

    names = ray._private.worker.global_worker.core_worker.resource_ids()
    bundles = {int(match.group(1)) for name in names if (match := re.search(r"_group_(\d+)_", name))}
    return {
        "bundles": sorted(bundles),
        "gpu_ids": sorted(str(gpu) for gpu in ray.get_gpu_ids()),
        "node": ray.get_runtime_context().get_node_id(),
    }


class TensorParallelWorkerProbe:
    """Stands in for one of vLLM's TP workers."""

    def report(self) -> dict:
        return placement_report()


class EngineProbe:
    """Stands in for `RolloutWorker` (takes its arguments) and, for a TP > 1 engine, starts its TP
    workers as vLLM's Ray executor does (vllm/v1/executor/ray_executor_v2.py: RayExecutorV2._init_executor):
    one actor per rank in the current placement group (ray_utils.initialize_ray_cluster:
    `ray.util.get_current_placement_group()`), rank r on bundle r of VLLM_RAY_BUNDLE_INDICES, with
    `num_cpus=0` and `num_gpus=VLLM_RAY_PER_WORKER_GPUS` (`_get_actor_resource_kwargs`)."""

    def __init__(self, backend: str, args: EngineArgs):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = ray.util.get_current_placement_group()
        bundles = list(map(int, os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")))
        assert len(bundles) == args.tensor_parallel_size
        share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
        self.workers = [
            ray.remote(TensorParallelWorkerProbe)
            .options(
                num_cpus=0,
                num_gpus=share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle
                ),
            )
            .remote()
            for bundle in bundles
        ]

    def report(self) -> dict:
        import ray

        return {
            **placement_report(),
            "backend": dist.get_backend(),
            "workers": ray.get([worker.report.remote() for worker in self.workers]),
        }
