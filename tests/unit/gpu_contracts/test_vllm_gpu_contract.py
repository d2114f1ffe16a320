"""megarl's calls into vLLM's GPU code paths fit the installed vLLM (0.32; its CUDA worker and model
runner ship in the CPU wheel too, so they can be inspected here). The CPU tests run the CPU worker,
which subclasses the GPU one (`vllm/v1/worker/cpu_worker.py:CPUWorker(Worker)`); these tests cover the
spots where the GPU path differs: sleep mode, the GPU worker's reload, the engine arguments that only
matter on GPU."""

import dataclasses
import inspect

import pytest

pytest.importorskip("vllm")

from call_sites import assert_fits, call_sites
from vllm import LLM
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker as GPUWorker

pytestmark = pytest.mark.unit

ENGINE = "workers/rollout/vllm_engine.py"
EXTENSION = "workers/rollout/worker_extension.py"


def test_engine_arguments_are_vllm_engine_args():
    """`LLM(**kwargs)` hands every keyword it does not name itself to `EngineArgs`
    (vllm/entrypoints/llm.py `LLM.__init__` → `EngineArgs(model=..., **kwargs)`): each keyword megarl
    passes must be a field of one of the two, or vLLM refuses it at start-up on the GPU cluster."""
    accepted = {field.name for field in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM).parameters)
    for site in call_sites(ENGINE, "LLM"):
        unknown = sorted(set(site.keywords) - accepted)
        assert not unknown, f"{site.where}: LLM(...) keywords {unknown} are not vLLM engine arguments"


def test_sleep_and_wake_up_fit_llm_and_gpu_worker():
    """`LLM.sleep(level=)` / `LLM.wake_up(tags=)` (vllm/entrypoints/llm.py) reach the GPU worker's
    `sleep(level)` / `wake_up(tags)` (vllm/v1/worker/gpu_worker.py) through a collective RPC."""
    assert_fits(call_sites(ENGINE, "sleep"), LLM.sleep, bound=True)
    assert_fits(call_sites(ENGINE, "wake_up"), LLM.wake_up, bound=True)
    assert "level" in inspect.signature(GPUWorker.sleep).parameters
    assert "tags" in inspect.signature(GPUWorker.wake_up).parameters


def test_waking_the_weights_tag_restores_the_weights():
    """The hand-over wakes an engine's weights alone before a sync (`wake_up(tags=["weights"])`,
    megarl.cluster.handover) and expects them back: after a level-2 sleep, gpu_worker.py
    `Worker.wake_up` restores the parameters it saved (those the checkpoint does not hold) when
    "weights" is among the tags; the sync then overwrites the rest. The KV cache comes back by its own tag."""
    assert all(site.keywords == ("tags",) and site.positional == 0 for site in call_sites(ENGINE, "wake_up"))
    assert 'tags is None or "weights" in tags' in inspect.getsource(GPUWorker.wake_up)


def test_reload_weights_fits_the_gpu_model_runner():
    """The worker extension calls `self.reload_weights(weights_iterator=..., is_checkpoint_format=True)`
    on the worker it is mixed into. The GPU worker passes everything through to the model runner
    (gpu_worker.py `Worker.reload_weights(*args, **kwargs)` → gpu_model_runner.py
    `GPUModelRunner.reload_weights(weights_iterator, weights_path, is_checkpoint_format)`)."""
    assert "self.model_runner.reload_weights(*args, **kwargs)" in inspect.getsource(GPUWorker.reload_weights)
    assert_fits(call_sites(EXTENSION, "reload_weights"), GPUModelRunner.reload_weights, bound=True)


def test_worker_attributes_the_extension_reads_exist_on_the_gpu_worker():
    """The extension and the per-rank load read `self.device`, `self.get_model()` and
    `self.vllm_config` of the worker: set by gpu_worker.py `Worker.init_device` / `WorkerBase`."""
    assert callable(GPUWorker.get_model)
    assert "self.device = " in inspect.getsource(GPUWorker.init_device)
    assert "self.vllm_config = " in inspect.getsource(inspect.getmro(GPUWorker)[1].__init__)
