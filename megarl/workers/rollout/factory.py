"""`make_rollout_engine`: a backend name and its `EngineArgs` in, a `RolloutEngine` out."""

from __future__ import annotations

from megarl.workers.rollout.base import RolloutEngine
from megarl.workers.rollout.engine_args import EngineArgs

BACKENDS = ("vllm", "hf")


def make_rollout_engine(backend: str, args: EngineArgs) -> RolloutEngine:
    """backend "vllm": `VLLMRolloutEngine` (every argument but `device`, which vLLM picks itself).
    backend "hf": `HFRolloutEngine` on `args.device` (TP 1 only; `dtype`, `return_routed_experts`; the
    vLLM-only arguments are unused). The backend modules are imported here, so a process that never asks for vLLM never
    imports it."""
    if backend == "vllm":
        from megarl.workers.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(args)
    if backend == "hf":
        if args.tensor_parallel_size != 1 or args.expert_parallel:
            raise ValueError(
                f"rollout backend 'hf' runs on one device: tensor_parallel_size={args.tensor_parallel_size}, "
                f"expert_parallel={args.expert_parallel}; use backend 'vllm' for TP > 1 or expert parallelism"
            )
        from megarl.workers.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(
            args.model_path, dtype=args.dtype, device=args.device, return_routed_experts=args.return_routed_experts
        )
    raise ValueError(f"rollout backend {backend!r} is not one of {BACKENDS}")
