"""`rollout.enforce_eager` reaches `vllm.LLM(enforce_eager=...)` through the rollout worker and factory,
"auto" resolved by the platform (eager on CPU, compiled on GPU).

Checked at the constructor: the platform answers "CPU" or "not CPU" and a recording stand-in for
`vllm.LLM` keeps the keyword arguments and stops the start. The keyword is checked against the
installed `vllm.LLM.__init__` (vllm/entrypoints/llm.py, `LLM.__init__`, a named parameter there, not
one swallowed by its **kwargs), so a renamed keyword fails here too. That a compiled engine on CPU
really generates, and after a weight sync generates from the new weights, is shown by
tests/e2e/rollout/test_compiled_engine_cpu.py.
"""

from __future__ import annotations

import inspect

import pytest
import vllm

from megarl.workers.rollout import vllm_engine
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.rollout.rollout_worker import RolloutWorker


class _Recorded(Exception):
    def __init__(self, kwargs: dict):
        super().__init__("recorded")
        self.kwargs = kwargs


def _record(**kwargs):
    raise _Recorded(kwargs)


def _llm_kwargs(monkeypatch, enforce_eager, on_cpu: bool = False) -> dict:
    monkeypatch.setattr(vllm_engine, "LLM", _record)
    monkeypatch.setattr(vllm_engine, "_set_cpu_environment", lambda *args: None)
    monkeypatch.setattr(vllm_engine.current_platform, "is_cpu", lambda: on_cpu)
    with pytest.raises(_Recorded) as recorded:
        RolloutWorker(
            "vllm",
            EngineArgs(
                "/no/model",
                max_model_len=64,
                enforce_eager=enforce_eager,
            ),
        )
    return recorded.value.kwargs


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_enforce_eager_reaches_the_gpu_engine(monkeypatch, enforce_eager):
    kwargs = _llm_kwargs(monkeypatch, enforce_eager)
    assert kwargs["enforce_eager"] is enforce_eager
    assert "enforce_eager" in inspect.signature(vllm.LLM.__init__).parameters


@pytest.mark.parametrize(("on_cpu", "eager"), [(True, True), (False, False)])
def test_auto_runs_eager_on_cpu_only(monkeypatch, on_cpu, eager):
    assert _llm_kwargs(monkeypatch, "auto", on_cpu)["enforce_eager"] is eager


def test_false_compiles_on_cpu_too(monkeypatch):
    assert _llm_kwargs(monkeypatch, False, on_cpu=True)["enforce_eager"] is False
