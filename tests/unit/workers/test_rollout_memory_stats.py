"""Where a rollout engine's memory figures come from (the hand-over's `memory/rollout/<phase>/*`). On GPU
with TP > 1 the engine's own process holds no GPU but sees all of the node's: a CUDA call there would open
a context on GPU 0 and report that GPU, so the figures must come from the TP workers (by name, through
`collective_rpc`); everywhere else from the engine's process (on CPU its RSS counts the TP workers it
started)."""

import pytest

pytest.importorskip("vllm")

from megarl.workers.rollout import base
from megarl.workers.rollout.vllm_engine import VLLMRolloutEngine

pytestmark = pytest.mark.unit


class _LLM:
    def __init__(self, per_worker):
        self.per_worker, self.calls = per_worker, []

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(method)
        return self.per_worker


def _engine(is_cpu: bool, tp: int, per_worker) -> VLLMRolloutEngine:
    """An engine object without a vLLM behind it: only what `memory_stats` reads."""
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine._is_cpu, engine._tensor_parallel_size, engine._llm = is_cpu, tp, _LLM(per_worker)
    return engine


def test_gpu_engine_of_tp2_asks_its_workers_and_never_cuda_here(monkeypatch):
    def no_local_stats():
        raise AssertionError("the engine's own process touched CUDA")

    monkeypatch.setattr(base, "memory_stats", no_local_stats)
    per_worker = [
        {"allocated_gib": 1.0, "reserved_gib": 2.0, "device_used_gib": 30.0},
        {"allocated_gib": 1.5, "reserved_gib": 1.0, "device_used_gib": 31.0},
    ]
    engine = _engine(is_cpu=False, tp=2, per_worker=per_worker)
    assert engine.memory_stats() == {"allocated_gib": 1.5, "reserved_gib": 2.0, "device_used_gib": 31.0}
    assert engine._llm.calls == ["memory_stats"]


@pytest.mark.parametrize("is_cpu, tp", [(True, 2), (False, 1), (True, 1)])
def test_other_engines_report_their_own_process(monkeypatch, is_cpu, tp):
    monkeypatch.setattr(base, "memory_stats", lambda: {"rss_gib": 3.0})
    engine = _engine(is_cpu=is_cpu, tp=tp, per_worker=[])
    assert engine.memory_stats() == {"rss_gib": 3.0}
    assert engine._llm.calls == []
