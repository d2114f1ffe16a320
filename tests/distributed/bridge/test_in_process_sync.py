"""The trainer-world half of the bridge with the in-process transport, without vLLM: a Megatron
actor (tied embeddings, so the last stage's `output_layer` copy must be skipped) trains, and every
rank syncs into a transformers engine living in its own process (colocated). On a TP layout rank 0
gathers shards, on a PP layout it receives the other stage's buckets, and it broadcasts each bucket
to the other ranks; every engine's probe log-probs equal the actor's after each of two rounds, and
the bridge's buffers stay within two buckets (one sent, the next assembled meanwhile) plus one
gathered parameter."""

from __future__ import annotations

import pytest

from megarl.bridge.plan import LayoutPair, build_plan
from megarl.models.hf_config import read_model_dims
from megarl.models.layout import padded_vocab_size
from megarl.models.tiny import make_tiny_model
from megarl.workers.sync_check import run_colocated_check

THRESHOLD = 1e-4
BUCKET_MB = 0.1


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("bridge_tied"),
        "llama",
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_in_process_sync_matches_the_actor(tied_llama, tp, pp):
    per_rank = run_colocated_check(
        tied_llama, train_tp=tp, train_pp=pp, backend="hf", threshold=THRESHOLD, rounds=2, bucket_mb=BUCKET_MB
    )
    dims = read_model_dims(tied_llama)
    plan = build_plan(dims, LayoutPair(tp, pp, 1), bucket_mb=BUCKET_MB)
    largest_bucket = max(b.nbytes for b in plan.buckets)
    # Two flat buckets plus one parameter's gathered shards (at most a bucket, or the padded vocabulary).
    largest_gather = max(largest_bucket, padded_vocab_size(dims.vocab_size, 128, tp) * dims.hidden_size * 4)
    assert len(per_rank) == tp * pp
    for first, second in per_rank:  # every rank's own engine
        for result in (first, second):
            assert result.metrics[1]["sync/logprob_max_abs_diff"] <= THRESHOLD
        assert (second.engine_logprobs[1] - first.engine_logprobs[1]).abs().max() > 100 * THRESHOLD
        assert first.sync_metrics["sync/buckets"] == len(plan.buckets) > 1
        assert 0 < first.sync_metrics["sync/peak_buffer_megabytes"] * 2**20 <= 2 * largest_bucket + largest_gather


def test_in_process_sync_with_virtual_stages(tmp_path_factory):
    """PP 2 × VPP 2: each stage holds two non-adjacent chunks (rank 0 layers 0 and 2, rank 1 layers 1 and 3),
    so the plan sends layers by the stage that holds them; the engine loads exactly the actor's tensors
    (`check_checksums`, inside `run_colocated_check`) and its log-probs follow the actor's."""
    model = make_tiny_model(
        tmp_path_factory.mktemp("bridge_vpp"),
        "llama",
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        num_hidden_layers=4,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    plan = build_plan(read_model_dims(model), LayoutPair(1, 2, 1, train_vpp=2), bucket_mb=BUCKET_MB)
    stages = {
        p.megatron_name.split(".")[2]: p.pp_rank
        for b in plan.buckets
        for p in b.params
        if p.megatron_name.startswith("decoder.layers.")
    }
    assert stages == {"0": 0, "1": 1, "2": 0, "3": 1}
    per_rank = run_colocated_check(
        model, train_tp=1, train_pp=2, train_vpp=2, backend="hf", threshold=THRESHOLD, rounds=2, bucket_mb=BUCKET_MB
    )
    for first, second in per_rank:
        for result in (first, second):
            assert result.metrics[1]["sync/logprob_max_abs_diff"] <= THRESHOLD
        assert (second.engine_logprobs[1] - first.engine_logprobs[1]).abs().max() > 100 * THRESHOLD
