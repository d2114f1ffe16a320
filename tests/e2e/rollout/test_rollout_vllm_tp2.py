"""The vLLM engine at TP 2 (multiprocess executor + worker extension), and the receiving side of the
cross-process weight sync: this test process plays a TP-1 trainer, rank 0 of the gloo sync group,
sending its shards to the two vLLM workers (ranks 1 and 2), which assemble the HF tensors."""

from __future__ import annotations

import pytest
import torch
from rollout_reference import PROMPTS, TOLERANCE, checkpoint_tensors, hf_logprobs, load_hf, sync_over_group

from megarl.bridge import InProcessTensors
from megarl.workers.rollout import SamplingConfig, make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def engine(base_model_dir):
    engine = make_rollout_engine(
        "vllm", EngineArgs(base_model_dir, tensor_parallel_size=2, dtype="float32", max_model_len=128)
    )
    yield engine
    engine.shutdown()


def test_tp2_generates_and_matches_hf(engine, base_model_dir):
    hf_base = load_hf(base_model_dir)
    outputs = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=6, seed=0))
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output.response_token_ids) == 2 and output.finish_reasons == ["length"] * 2
        for tokens, logprobs in zip(output.response_token_ids, output.response_logprobs):
            expected = hf_logprobs(hf_base, prompt + tokens)[len(prompt) - 1 :]
            torch.testing.assert_close(logprobs, expected, atol=TOLERANCE, rtol=0)


def test_a_call_seed_reaches_the_worker_processes(engine):
    """`seed_each_sample=False` at TP 2: the samplers run in the two worker processes, so the reseed
    must reach both (`collective_rpc("seed_sampling")`); else their generators move on and the
    repeated call differs."""
    sampling = SamplingConfig(n=3, max_new_tokens=6, seed=5, seed_each_sample=False)
    first, again = (engine.generate(PROMPTS, sampling) for _ in range(2))
    assert [o.response_token_ids for o in first] == [o.response_token_ids for o in again]


def _assert_engine_matches(engine, hf_model) -> None:
    for sequence, got in zip(PROMPTS, engine.prompt_logprobs(PROMPTS)):
        torch.testing.assert_close(got, hf_logprobs(hf_model, sequence), atol=TOLERANCE, rtol=0)


def test_gloo_weight_sync_loads_new_weights(engine, base_model_dir, new_model_dir):
    """This process plays a TP-1 trainer (group rank 0) sending its shards in many small buckets; both
    workers assemble the HF tensors and load them in one pass."""
    hf_base, hf_new = load_hf(base_model_dir), load_hf(new_model_dir)
    _assert_engine_matches(engine, hf_base)
    version = engine.weight_version
    plan = sync_over_group(
        engine, 2, new_model_dir, checkpoint_tensors(new_model_dir), bucket_mb=0.05, timeout_s=TIMEOUT_S
    )
    try:
        assert len(plan.buckets) > 2 and engine.weight_version == version + 1
        _assert_engine_matches(engine, hf_new)
        # And generation uses them: sampled log-probs are the new model's.
        output = engine.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=6, seed=1))[0]
        tokens = output.response_token_ids[0]
        expected = hf_logprobs(hf_new, PROMPTS[0] + tokens)[len(PROMPTS[0]) - 1 :]
        torch.testing.assert_close(output.response_logprobs[0], expected, atol=TOLERANCE, rtol=0)
    finally:
        engine.receive(InProcessTensors(checkpoint_tensors(base_model_dir).items())).result()


def test_load_weights_reaches_the_worker_processes(engine, base_model_dir, new_model_dir):
    """`load_weights` from this process: the tensors are pickled to both TP workers."""
    hf_base, hf_new = load_hf(base_model_dir), load_hf(new_model_dir)
    _assert_engine_matches(engine, hf_base)
    version = engine.weight_version
    try:
        engine.receive(InProcessTensors(checkpoint_tensors(new_model_dir).items())).result()
        assert engine.weight_version == version + 1
        _assert_engine_matches(engine, hf_new)
    finally:
        engine.receive(InProcessTensors(checkpoint_tensors(base_model_dir).items())).result()
    _assert_engine_matches(engine, hf_base)


def test_memory_stats_come_from_the_worker_processes(engine):
    """`memory_stats` by name in each TP worker (what a GPU engine of TP > 1 asks, whose own process holds
    no GPU: `VLLMRolloutEngine.memory_stats`; the choice itself is tested in
    tests/unit/workers/test_rollout_memory_stats.py): each worker reports its own process."""
    per_worker = engine._llm.collective_rpc("memory_stats")
    assert len(per_worker) == 2
    assert all(set(stats) == {"rss_gib"} and stats["rss_gib"] > 0 for stats in per_worker)
