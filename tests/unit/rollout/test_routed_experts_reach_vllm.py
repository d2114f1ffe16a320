"""`actor.moe.router_replay` asks vLLM for the routed experts: `enable_return_routed_experts` reaches
`vllm.LLM` through the rollout worker and factory with the Model Runner V2 that serves them
(vllm/config/vllm.py: "AuxOutput Connector requires Model Runner V2"), and where vLLM has no Triton (this
CPU build without triton-cpu) the engine refuses to start, naming the setting and the ways out.

As in test_enforce_eager_reaches_vllm.py, a recording stand-in for `vllm.LLM` keeps the keyword arguments;
the keyword is checked against the installed vLLM (an `EngineArgs` field, which `LLM.__init__` takes through
its **kwargs), and the output field the engine reads against `CompletionOutput`."""

from __future__ import annotations

import dataclasses
import os

import pytest
import vllm
import vllm.triton_utils
from vllm.outputs import CompletionOutput

from megarl.workers.rollout import EngineArgs, vllm_engine
from megarl.workers.rollout.rollout_worker import RolloutWorker


class _Recorded(Exception):
    def __init__(self, kwargs: dict):
        super().__init__("recorded")
        self.kwargs = kwargs


def _record(**kwargs):
    raise _Recorded(kwargs)


def _start(monkeypatch, return_routed_experts: bool) -> None:
    monkeypatch.setattr(vllm_engine, "LLM", _record)
    monkeypatch.setattr(vllm_engine, "_set_cpu_environment", lambda *args: None)
    # Set, then removed: monkeypatch records the variable's state only when it changes it, and the engine
    # sets it; a bare delenv of an absent variable left the engine's value to every later test.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    RolloutWorker(
        "vllm",
        EngineArgs(
            "/no/model",
            max_model_len=64,
            enforce_eager=True,
            return_routed_experts=return_routed_experts,
        ),
    )


@pytest.mark.parametrize("asked", [True, False])
def test_the_setting_reaches_vllm_with_its_model_runner(monkeypatch, asked):
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    with pytest.raises(_Recorded) as recorded:
        _start(monkeypatch, asked)
    assert recorded.value.kwargs["enable_return_routed_experts"] is asked
    assert (os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1") is asked
    assert "enable_return_routed_experts" in {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert "routed_experts" in {f.name for f in dataclasses.fields(CompletionOutput)}


def test_without_triton_the_engine_refuses_naming_the_setting(monkeypatch):
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", False)
    with pytest.raises(
        ValueError, match="actor.moe.router_replay: vLLM returns the routed experts only from its Model"
    ):
        _start(monkeypatch, True)
