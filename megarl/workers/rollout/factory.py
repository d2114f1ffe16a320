"""`make_rollout_engine`: plain arguments in, a `RolloutEngine` out (the trainer maps config to them)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from megarl.workers.rollout.base import RolloutEngine

BACKENDS = ("vllm", "hf")


def make_rollout_engine(
    backend: str,
    model_path: str | Path,
    *,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    cpu_kv_cache_gib: int = 1,
    gpu_memory_utilization: float = 0.5,
    enforce_eager: bool | Literal["auto"] = "auto",
    sleep_level: int = 2,
    expert_parallel: bool = False,
    device: str = "cpu",
    return_routed_experts: bool = False,
) -> RolloutEngine:
    """backend "vllm": `VLLMRolloutEngine` (all arguments but `device`, which vLLM picks itself).
    backend "hf": `HFRolloutEngine` on `device` (TP 1 only; `dtype`, `return_routed_experts`; the
    vLLM-only arguments are unused). The backend modules are imported here, so a process that never asks for vLLM never
    imports it."""
    if backend == "vllm":
        from megarl.workers.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(
            model_path,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            cpu_kv_cache_gib=cpu_kv_cache_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            sleep_level=sleep_level,
            return_routed_experts=return_routed_experts,
            expert_parallel=expert_parallel,
        )
    if backend == "hf":
        if tensor_parallel_size != 1 or expert_parallel:
            raise ValueError(
                f"rollout backend 'hf' runs on one device: tensor_parallel_size={tensor_parallel_size}, "
                f"expert_parallel={expert_parallel}; use backend 'vllm' for TP > 1 or expert parallelism"
            )
        from megarl.workers.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(model_path, dtype=dtype, device=device, return_routed_experts=return_routed_experts)
    raise ValueError(f"rollout backend {backend!r} is not one of {BACKENDS}")
