"""The vLLM engine at TP 2 (multiprocess executor + worker extension), and the receiving side of the
cross-process weight sync: this test process plays the trainer, rank 0 of the gloo sync group,
broadcasting packed buckets to the two vLLM workers (ranks 1 and 2)."""

from __future__ import annotations

import pytest
import torch
from rollout_reference import PROMPTS, TOLERANCE, checkpoint_tensors, free_port, hf_logprobs, load_hf

from megarl.workers.rollout import SamplingConfig, make_rollout_engine, pack
from megarl.workers.rollout.sync_group import broadcast_bucket, create_weight_sync_group

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def engine(base_model_dir):
    engine = make_rollout_engine(
        "vllm", base_model_dir, tensor_parallel_size=2, dtype="float32", max_model_len=128
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


def _buckets_splitting_fused_layers(tensors: dict[str, torch.Tensor]):
    """Three buckets, cut so that q_proj and k/v_proj of layer 0 (one fused qkv_proj in vLLM) and
    gate/up of layer 1 (one gate_up_proj) land in different buckets."""
    names = list(tensors)
    cuts = [
        names.index("model.layers.0.self_attn.k_proj.weight"),
        names.index("model.layers.1.mlp.up_proj.weight"),
    ]
    assert 0 < cuts[0] < cuts[1] < len(names)
    groups = [names[: cuts[0]], names[cuts[0] : cuts[1]], names[cuts[1] :]]
    return [pack((name, tensors[name]) for name in group) for group in groups]


def _assert_engine_matches(engine, hf_model) -> None:
    for sequence, got in zip(PROMPTS, engine.prompt_logprobs(PROMPTS)):
        torch.testing.assert_close(got, hf_logprobs(hf_model, sequence), atol=TOLERANCE, rtol=0)


def test_gloo_weight_sync_loads_new_weights(engine, base_model_dir, new_model_dir):
    hf_base, hf_new = load_hf(base_model_dir), load_hf(new_model_dir)
    _assert_engine_matches(engine, hf_base)
    port = free_port()
    joined = engine.init_weight_sync("127.0.0.1", port, world_size=3, timeout_s=TIMEOUT_S)
    group = create_weight_sync_group("127.0.0.1", port, 0, 3, TIMEOUT_S)
    joined.result(timeout=TIMEOUT_S)

    buckets = _buckets_splitting_fused_layers(checkpoint_tensors(new_model_dir))
    version = engine.weight_version
    engine.pause()
    loaded = engine.receive_weights([metadata for _, metadata in buckets])
    for flat, _ in buckets:
        broadcast_bucket(group, flat)
    loaded.result(timeout=TIMEOUT_S)
    engine.resume()
    try:
        assert engine.weight_version == version + 1
        _assert_engine_matches(engine, hf_new)
        # And generation uses them: sampled log-probs are the new model's.
        output = engine.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=6, seed=1))[0]
        tokens = output.response_token_ids[0]
        expected = hf_logprobs(hf_new, PROMPTS[0] + tokens)[len(PROMPTS[0]) - 1 :]
        torch.testing.assert_close(output.response_logprobs[0], expected, atol=TOLERANCE, rtol=0)
    finally:
        engine.load_weights(checkpoint_tensors(base_model_dir).items())


def test_load_weights_reaches_the_worker_processes(engine, base_model_dir, new_model_dir):
    """`load_weights` from this process: the tensors are pickled to both TP workers."""
    hf_base, hf_new = load_hf(base_model_dir), load_hf(new_model_dir)
    _assert_engine_matches(engine, hf_base)
    version = engine.weight_version
    try:
        engine.load_weights(checkpoint_tensors(new_model_dir).items())
        assert engine.weight_version == version + 1
        _assert_engine_matches(engine, hf_new)
    finally:
        engine.load_weights(checkpoint_tensors(base_model_dir).items())
    _assert_engine_matches(engine, hf_base)
