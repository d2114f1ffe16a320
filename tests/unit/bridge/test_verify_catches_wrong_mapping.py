"""Verification without processes: the bridge's buckets loaded into a transformers engine match the
"actor" (the same weights loaded directly); a deliberately wrong gate/up merge is caught by the
log-prob check, and the round-trip check names the parameter."""

from __future__ import annotations

import pytest
import torch
from bridge_emulate import emulated_buckets, megatron_shards, naive_gate_up_merge_into
from safetensors.torch import load_file

import megarl.bridge.convert as convert
from megarl.bridge import InProcessTensors
from megarl.bridge.collect import round_trips
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.transports import InProcessTransport
from megarl.bridge.verify import SyncVerificationError, check_sync, probe_token_ids
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model
from megarl.workers.rollout.hf_engine import HFRolloutEngine

LAYOUT = LayoutPair(train_tp=2, train_pp=1, rollout_tp=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("bridge_verify"),
        "qwen2",
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def trained(model_dir):
    """The 'actor' weights: the checkpoint moved by a seeded perturbation."""
    generator = torch.Generator().manual_seed(1)
    base = load_file(model_dir / "model.safetensors")
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in base.items()}


def sync_and_check(model_dir, trained):
    dims = read_model_dims(model_dir)
    plan = build_plan(dims, LAYOUT)
    shards = megatron_shards(plan, trained)
    actor = HFRolloutEngine(model_dir, dtype="float32")
    actor.receive(InProcessTensors(trained.items())).result()
    probe = probe_token_ids(dims.vocab_size)
    engine = HFRolloutEngine(model_dir, dtype="float32")
    InProcessTransport(engine).send(iter(emulated_buckets(plan, shards)))
    suspects = [p.megatron_name for p in plan.params if not round_trips(p, shards[p.megatron_name], plan)]
    actor_logprobs = torch.stack(actor.prompt_logprobs(probe))
    return check_sync(engine.prompt_logprobs(probe), actor_logprobs, threshold=1e-5, layout=LAYOUT, suspects=suspects)


def test_correct_mapping_passes(model_dir, trained):
    metrics = sync_and_check(model_dir, trained)
    assert metrics["sync/logprob_max_abs_diff"] <= 1e-5
    assert set(metrics) == {"sync/logprob_max_abs_diff", "sync/logprob_mean_abs_diff"}


def test_naive_gate_up_merge_is_caught_and_named(model_dir, trained, monkeypatch):
    monkeypatch.setattr(convert, "merge_tp_shards_into", naive_gate_up_merge_into)
    with pytest.raises(SyncVerificationError) as error:
        sync_and_check(model_dir, trained)
    message = str(error.value)
    assert "train TP=2/PP=1 → rollout TP=1" in message
    assert "decoder.layers.0.mlp.linear_fc1.weight" in message and "decoder.layers.1.mlp.linear_fc1.weight" in message
    assert "linear_qkv" not in message and "linear_proj" not in message
