"""Plain worker classes hosted by the worker-group tests (imported inside Ray actor processes)."""

import os
import time

import torch
import torch.distributed as dist


class SumWorker:
    """All-reduces a value over the group: proves the ranks form one torch.distributed world."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def all_reduce(self, value: float) -> float:
        t = torch.tensor([value + self.offset], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

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
