"""`make_rollout_engine`: a backend name and its `EngineArgs` in, a `RolloutEngine` out."""

from __future__ import annotations

from megarl.config.engines import engine_capabilities
from megarl.workers.rollout.base import RolloutEngine
from megarl.workers.rollout.engine_args import EngineArgs


def make_rollout_engine(backend: str, args: EngineArgs) -> RolloutEngine:
    """backend "vllm": `VLLMRolloutEngine` (every argument but `device`, which vLLM picks itself).
    backend "hf": `HFRolloutEngine` on `args.device` (TP 1 only; `dtype`, `return_routed_experts`; the
    vLLM-only arguments are unused). The backend modules are imported here, so a process that never asks for vLLM never
    imports it."""
    capabilities = engine_capabilities(backend)
    if capabilities.max_tensor_parallel is not None and args.tensor_parallel_size > capabilities.max_tensor_parallel:
        raise ValueError(
            f"rollout backend {backend!r} runs at most TP {capabilities.max_tensor_parallel}: "
            f"tensor_parallel_size={args.tensor_parallel_size}; use a backend with tensor parallelism (e.g. 'vllm')"
        )
    if args.expert_parallel and not capabilities.expert_parallel:
        raise ValueError(
            f"rollout backend {backend!r} has no expert parallelism; use backend 'vllm' or expert_parallel=False"
        )
    if backend == "vllm":
        from megarl.workers.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(args)
    if backend == "hf":
        from megarl.workers.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(
            args.model_path, dtype=args.dtype, device=args.device, return_routed_experts=args.return_routed_experts
        )
    raise AssertionError(f"rollout backend {backend!r} has capabilities but no engine class in this factory")
