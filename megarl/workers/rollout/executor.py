"""Which vLLM distributed executor runs a rollout engine's TP workers, and on which devices.

    TP 1           "uni": the one worker runs in the engine's process, on the device its actor holds.
    TP > 1, CPU    "mp":  vLLM starts the TP workers as processes of the engine's process (same node).
    TP > 1, GPU    "ray": vLLM's Ray executor starts one Ray actor per TP rank, each on one GPU bundle.

On GPU the engine's own actor holds no GPU (its workers hold them) and runs inside the job's placement
group, so vLLM's executor takes that group (`vllm/v1/executor/ray_utils.py: initialize_ray_cluster`
reads `ray.util.get_current_placement_group()`) and places TP rank r on the r-th bundle of
`VLLM_RAY_BUNDLE_INDICES`, with `VLLM_RAY_PER_WORKER_GPUS` of its GPU (`vllm/envs.py`; read by
`vllm/v1/executor/ray_executor_v2.py: RayExecutorV2._init_executor` / `_get_actor_resource_kwargs`, and
by `ray_executor.py: RayDistributedExecutor._init_workers_ray`): a share of 1 when colocated roles sit
on the same GPUs. `engine_env` is computed by the driver and set in the engine's process before vLLM
reads it; `executor_backend` is asked by the engine.
"""

BUNDLE_INDICES_ENV = "VLLM_RAY_BUNDLE_INDICES"
"""Comma-separated placement-group bundle per TP rank of the engine."""
PER_WORKER_GPUS_ENV = "VLLM_RAY_PER_WORKER_GPUS"
"""The GPU share each TP worker's Ray actor asks of its bundle."""


def executor_backend(tensor_parallel_size: int, on_gpu: bool) -> str:
    """vLLM's `distributed_executor_backend` for an engine of `tensor_parallel_size` workers."""
    if tensor_parallel_size == 1:
        return "uni"
    return "ray" if on_gpu else "mp"


def engine_env(bundles: list[int], gpus_per_worker: float) -> dict[str, str]:
    """The environment that places a TP > 1 engine's Ray workers: TP rank r on `bundles[r]`, each taking
    `gpus_per_worker` of that bundle's GPU. Unread by the "uni" and "mp" executors."""
    return {BUNDLE_INDICES_ENV: ",".join(map(str, bundles)), PER_WORKER_GPUS_ENV: repr(float(gpus_per_worker))}


def engine_holds_gpu(tensor_parallel_size: int) -> bool:
    """Whether the engine's own process takes its bundle's GPU share: only a TP 1 engine, whose worker
    runs in it; a wider engine's GPUs belong to its TP workers."""
    return tensor_parallel_size == 1
