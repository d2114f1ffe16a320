"""Placements the trainer cannot run yet, for a device: checked by `validate` and again once `train` knows
the cluster (`cluster_problems`, with `trainer.device` resolved by `resolve_device`).

`device` is `trainer.device` ("auto", "cpu" or "cuda"), or what the driver resolved it to on the Ray
cluster ("cpu" or "cuda"). For "auto" only the problems that hold on every device it may resolve to are
reported; the rest are reported by `train` once the cluster has decided (the same function, resolved).
Nothing here asks the machine running it for a GPU: the driver's CUDA says nothing about the cluster's.
"""

from megarl.config.config import Config
from megarl.config.problems import Problem

RESOLVED = {"auto": ("cpu", "cuda"), "cpu": ("cpu",), "cuda": ("cuda",)}
"""The devices a `trainer.device` value may run on."""


def placement_problems(config: Config, device: str) -> list[Problem]:
    """Valid settings that the placement of the worker groups cannot host on `device`: none today (rollout
    engines span `rollout.tensor_model_parallel_size` device bundles on every device and placement)."""
    return []


def resolve_device(setting: str, cluster_gpus: float) -> str:
    """"cpu" or "cuda" for `trainer.device` = `setting` on a Ray cluster with `cluster_gpus` GPU resources
    (`auto`: CUDA when it has any). A `cuda` setting without GPUs is a `cluster_problems` problem."""
    if setting == "auto":
        return "cuda" if cluster_gpus > 0 else "cpu"
    return setting


def cluster_problems(config: Config, cluster_gpus: float) -> list[Problem]:
    """What `train` refuses once the Ray cluster is known: `trainer.device: cuda` without GPUs, and the
    placement problems of the resolved device."""
    if config.trainer.device == "cuda" and cluster_gpus <= 0:
        return [Problem(
            "trainer.device", "cuda", "the Ray cluster has 0 GPU resources",
            "start the Ray nodes with their GPUs (`ray start --num-gpus N`, rayStartParams num-gpus on KubeRay) "
            "or use trainer.device: cpu",
        )]
    return placement_problems(config, resolve_device(config.trainer.device, cluster_gpus))
