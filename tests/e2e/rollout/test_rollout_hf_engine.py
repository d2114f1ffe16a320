"""The HuggingFace `generate` backend beyond the engine contract (test_engine_contract.py): pad-id context
tokens, per-prompt caps and seeds, a call seed, an unknown tensor, a mixture of experts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_reference import PROMPTS, TOLERANCE, checkpoint_tensors, load_hf, response_logprobs_of

from megarl.bridge import InProcessTensors
from megarl.workers.rollout import SamplingConfig, make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

MAX_NEW = 6


@pytest.fixture(scope="module")
def engine(base_model_dir):
    engine = make_rollout_engine("hf", EngineArgs(base_model_dir, dtype="float32"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_base(base_model_dir):
    return load_hf(base_model_dir)


def test_a_context_holding_the_pad_id_is_attended_whole(engine, hf_base):
    """A context token equal to the pad id (0: a prompt's, or one the model sampled, which a continued segment
    or turn sends back) is a real token: the log-probs are those of a forward that attends to it."""
    context = [*PROMPTS[0][:2], 0, *PROMPTS[0][2:]]
    output = engine.generate([context], SamplingConfig(n=1, temperature=0.7, max_new_tokens=MAX_NEW, seed=2))[0]
    tokens = output.response_token_ids[0]
    expected = response_logprobs_of(hf_base, context, tokens, temperature=0.7)
    torch.testing.assert_close(output.response_logprobs[0], expected, atol=TOLERANCE, rtol=0)


def test_per_prompt_token_caps_and_seeds(engine):
    """`max_new_tokens` per prompt (an agent loop's trajectories have different budgets left): each prompt
    stops at its own cap ("length") or earlier at a stop token ("stop"); `seeds` per prompt: a prompt's
    samples are those it gets alone with that seed, whatever else is in the call."""
    sampling = SamplingConfig(n=2, temperature=0.7, max_new_tokens=MAX_NEW, seed=3)
    capped = engine.generate(PROMPTS[:2], sampling, [3, 5])
    assert [[len(tokens) for tokens in output.response_token_ids] for output in capped] == [[3, 3], [5, 5]]
    assert [[len(lp) for lp in output.response_logprobs] for output in capped] == [[3, 3], [5, 5]]
    assert [output.finish_reasons for output in capped] == [["length", "length"]] * 2

    greedy = [
        output.response_token_ids[0]
        for output in engine.generate(PROMPTS[:2], SamplingConfig(greedy=True, max_new_tokens=MAX_NEW))
    ]
    stop = greedy[1][1]
    stopped = engine.generate(
        PROMPTS[:2], SamplingConfig(greedy=True, max_new_tokens=MAX_NEW, stop_token_ids=(stop,)), [3, 5]
    )
    for tokens, output, cap in zip(greedy, stopped, [3, 5]):
        cut = tokens[:cap][: tokens[:cap].index(stop) + 1] if stop in tokens[:cap] else tokens[:cap]
        assert output.response_token_ids == [cut]
        assert output.finish_reasons == ["stop" if cut[-1] == stop else "length"]
    assert stopped[1].finish_reasons == ["stop"] and len(stopped[1].response_token_ids[0]) <= 2

    mixed = engine.generate(PROMPTS[:2], sampling, [MAX_NEW, MAX_NEW], [11, 22])
    alone = engine.generate(PROMPTS[1:2], replace(sampling, seed=22))
    assert mixed[1].response_token_ids == alone[0].response_token_ids


def test_a_call_seed_makes_the_call_reproducible(engine):
    """`seed_each_sample=False`: one seed for the call, the prompts drawing in sequence (an unseeded call
    after `torch.manual_seed(seed)`), so a prompt's samples depend on the prompts before it; the same
    call repeats after other draws."""
    sampling = SamplingConfig(n=2, temperature=0.7, max_new_tokens=MAX_NEW, seed=3, seed_each_sample=False)
    first = engine.generate(PROMPTS[:2], sampling)
    torch.manual_seed(3)
    unseeded = engine.generate(PROMPTS[:2], replace(sampling, seed=None))
    assert [o.response_token_ids for o in first] == [o.response_token_ids for o in unseeded]
    torch.rand(1000)
    again = engine.generate(PROMPTS[:2], sampling)
    assert [o.response_token_ids for o in first] == [o.response_token_ids for o in again]
    alone = engine.generate(PROMPTS[1:2], sampling)  # now first in its call: other noise
    assert alone[0].response_token_ids != first[1].response_token_ids


def test_a_tensor_the_model_lacks_is_refused(engine):
    version = engine.weight_version
    with pytest.raises(ValueError, match="no parameters named"):
        engine.receive(InProcessTensors([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))]))
    assert engine.weight_version == version


def test_a_mixture_of_experts_loads_the_checkpoints_per_expert_tensors(tmp_path):
    """A Qwen3-MoE checkpoint names each expert's tensors (`mlp.experts.{e}.gate_proj.weight`, as the bridge
    sends them); transformers 5 holds them fused (`gate_up_proj [E, 2f, h]`, `down_proj [E, h, f]`). Loaded
    into an engine started from other weights, they give the log-probs of an engine started from them; and
    the routing the engine returns is that of the weights it holds."""
    from megarl.models.tiny import make_tiny_model

    first = make_tiny_model(tmp_path / "first", "qwen3_moe", seed=0, initializer_range=0.1)
    second = make_tiny_model(tmp_path / "second", "qwen3_moe", seed=1, initializer_range=0.1)
    engine = make_rollout_engine("hf", EngineArgs(first, dtype="float32", return_routed_experts=True))
    expected = make_rollout_engine("hf", EngineArgs(second, dtype="float32", return_routed_experts=True))
    try:
        engine.receive(InProcessTensors(checkpoint_tensors(second).items())).result()
        for got, want in zip(engine.prompt_logprobs(PROMPTS), expected.prompt_logprobs(PROMPTS)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        greedy = SamplingConfig(greedy=True, max_new_tokens=MAX_NEW)
        got, want = engine.generate(PROMPTS, greedy), expected.generate(PROMPTS, greedy)
        assert [o.response_token_ids for o in got] == [o.response_token_ids for o in want]
        for a, b in zip(got, want):
            assert torch.equal(a.routed_experts[0], b.routed_experts[0])
            assert a.routed_experts[0].shape[0] == len(a.prompt_token_ids) + len(a.response_token_ids[0]) - 1
    finally:
        engine.shutdown()
        expected.shutdown()
