"""Which device a process computes on, decided once by the driver and handed to every worker.

The driver resolves `trainer.device` against the Ray cluster (`megarl.config.placement.resolve_device`:
`auto` means CUDA when the cluster has GPU resources), never against its own CUDA: on KubeRay the driver runs on a head pod
without a GPU while the workers have them, and a `trainer.device: cpu` run on a GPU machine must stay
on the CPU. The decision reaches each worker process in `MEGARL_DEVICE`; every place in megarl that
would ask `torch.cuda.is_available()` asks `uses_cuda()` instead. A process started outside megarl's
worker groups (torchrun, `megarl.parallel.spawn`) has no decision to read and uses CUDA when it sees it.

Which GPU: Ray narrows `CUDA_VISIBLE_DEVICES` of a GPU actor to its assigned ids, so the CUDA ordinal of
the assigned GPU is its position among the visible ones (`visible_index`), not the id itself.
"""

import os
from collections.abc import Sequence

import torch

DEVICE_ENV = "MEGARL_DEVICE"
"""The resolved device of a run ("cpu" or "cuda"), set by the driver in every worker's environment."""
DEVICES = ("cpu", "cuda")


class DeviceError(RuntimeError):
    """A process cannot find its GPU, or was handed no valid device decision."""


def worker_env(device: str) -> dict[str, str]:
    """The environment that hands the driver's decision ("cpu" or "cuda") to a worker process. On the CPU
    the process also sees no GPU, so no library (vLLM's platform detection, megatron-core) can pick one
    up: Ray 2.60 leaves CUDA_VISIBLE_DEVICES of an actor without GPUs as the node has it
    (ray/_private/utils.py: set_visible_accelerator_ids skips zero ids unless
    RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO is set)."""
    return {DEVICE_ENV: device, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}


def uses_cuda() -> bool:
    """Whether this process computes on CUDA: the driver's decision (`MEGARL_DEVICE`) when there is one."""
    decided = os.environ.get(DEVICE_ENV)
    if decided is None:
        return torch.cuda.is_available()
    if decided not in DEVICES:
        raise DeviceError(f"{DEVICE_ENV}={decided!r} is not one of {DEVICES}")
    return decided == "cuda"


def visible_index(assigned: Sequence[str | int], visible: str | None) -> int:
    """The CUDA ordinal of a process's first assigned GPU.

    `assigned`: the GPU ids Ray gave the process (`ray.get_gpu_ids()`, in no particular order; one id
    for a fractional share); `visible`: its `CUDA_VISIBLE_DEVICES` (None when unset, then every GPU of
    the node is visible and an id is its own ordinal). CUDA numbers the visible devices 0, 1, ... in
    list order, so the ordinal is the id's position in that list; of several ids, the first listed.
    """
    if not assigned:
        raise DeviceError("this process was assigned no GPU, so it has no CUDA device to use")
    ids = [str(gpu) for gpu in assigned]
    if visible is None:
        return min(int(gpu) for gpu in ids)
    listed = [entry.strip() for entry in visible.split(",")]
    missing = [gpu for gpu in ids if gpu not in listed]
    if missing:
        raise DeviceError(
            f"GPU ids {missing} assigned by Ray are not in CUDA_VISIBLE_DEVICES={visible!r}; let Ray set "
            "CUDA_VISIBLE_DEVICES (unset RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, or list every GPU of the node)"
        )
    return min(listed.index(gpu) for gpu in ids)
