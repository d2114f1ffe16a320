"""The sync plan and the gather conversion, without processes: for every layout pair, replaying the
plan over shards made by the checkpoint loader writes every element of every HF tensor exactly once
and reproduces the checkpoint; buckets respect the size limit."""

from __future__ import annotations

import math

import pytest
import torch
from bridge_emulate import CONFIGS, dims_of, emulated_buckets, megatron_shards, random_hf_tensors

from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.protocol import unpack
from megarl.models.layout import hf_param_shapes

LAYOUTS = [LayoutPair(tp, pp, rtp) for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)] for rtp in (1, 2)]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda pair: f"tp{pair.train_tp}pp{pair.train_pp}-rtp{pair.rollout_tp}")
def test_every_hf_element_is_written_exactly_once_and_correctly(arch, layout):
    dims = dims_of(arch)
    plan = build_plan(dims, layout, bucket_mb=0.25)
    hf = random_hf_tensors(dims)
    received: dict[str, torch.Tensor] = {}
    for flat, metadata in emulated_buckets(plan, megatron_shards(plan, hf)):
        # Slots tile the buffer: back to back from 0 to its end, nothing left unwritten (NaN).
        ends = [slot.offset + slot.numel for slot in metadata.slots]
        assert [slot.offset for slot in metadata.slots] == [0] + ends[:-1] and ends[-1] == flat.numel()
        assert not flat.isnan().any()
        for name, tensor in unpack(flat, metadata):
            assert name not in received, f"{name} sent twice"
            received[name] = tensor
    assert received.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(received[name], tensor), name
    if dims.tie_word_embeddings:
        assert "lm_head.weight" not in received


@pytest.mark.parametrize("bucket_mb", [0.05, 0.25, 64])
def test_buckets_stay_within_the_limit_and_never_straddle_stages(bucket_mb):
    dims = dims_of("qwen2")
    plan = build_plan(dims, LayoutPair(2, 2, 1), bucket_mb=bucket_mb)
    limit = bucket_mb * 2**20
    oversize = [b for b in plan.buckets if b.nbytes > limit]
    assert all(len(b.params) == 1 for b in oversize)
    assert all(len({p.pp_rank for p in b.params}) == 1 == len({b.pp_rank, b.params[0].pp_rank}) for b in plan.buckets)
    # Stages send in order; each parameter lands in one bucket; sizes add up to the checkpoint.
    assert [b.pp_rank for b in plan.buckets] == sorted(b.pp_rank for b in plan.buckets)
    names = [p.megatron_name for p in plan.params]
    assert len(names) == len(set(names))
    total = sum(math.prod(s) for s in hf_param_shapes(dims).values()) * 4
    assert sum(b.nbytes for b in plan.buckets) == total
    if bucket_mb == 0.05:
        assert oversize, "the small limit must exercise the single-oversize-unit rule"
    if bucket_mb == 64:
        assert len(plan.buckets) == 2  # one per stage


def test_layers_go_to_their_pipeline_stage():
    dims = dims_of("qwen2")  # 4 layers
    plan = build_plan(dims, LayoutPair(1, 2, 1))
    stage = {p.megatron_name: p.pp_rank for p in plan.params}
    assert stage["embedding.word_embeddings.weight"] == 0
    assert stage["decoder.layers.1.mlp.linear_fc2.weight"] == 0
    assert stage["decoder.layers.2.input_layernorm.weight"] == 1
    assert stage["output_layer.weight"] == stage["decoder.final_layernorm.weight"] == 1
    qkv = next(p for p in plan.params if "model.layers.3.self_attn.k_proj.weight" in p.hf_names)
    assert qkv.megatron_name == "decoder.layers.3.self_attention.linear_qkv.weight" and qkv.pp_rank == 1


def test_virtual_stages_send_their_round_robin_layers():
    """PP 2 × VPP 2 of 4 layers: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3 (megatron's chunk order)."""
    dims = dims_of("qwen2")
    stage = {p.megatron_name: p.pp_rank for p in build_plan(dims, LayoutPair(1, 2, 1, train_vpp=2)).params}
    assert [stage[f"decoder.layers.{i}.input_layernorm.weight"] for i in range(4)] == [0, 1, 0, 1]
    assert stage["embedding.word_embeddings.weight"] == 0 and stage["decoder.final_layernorm.weight"] == 1
    with pytest.raises(ValueError, match="train PP=2 × VPP=4 does not divide num_hidden_layers=4"):
        build_plan(dims, LayoutPair(1, 2, 1, train_vpp=4))
    with pytest.raises(ValueError, match="train VPP=2 needs train PP > 1"):
        build_plan(dims, LayoutPair(1, 1, 1, train_vpp=2))


def test_plan_is_built_once_per_layout_pair():
    dims = dims_of("llama")
    assert build_plan(dims, LayoutPair(2, 1, 2), bucket_mb=16) is build_plan(dims, LayoutPair(2, 1, 2), bucket_mb=16)
    assert build_plan(dims, LayoutPair(2, 1, 2), bucket_mb=16) is not build_plan(
        dims, LayoutPair(2, 1, 1), bucket_mb=16
    )


def test_layouts_that_do_not_fit_are_reported_together():
    dims = dims_of("qwen2", num_hidden_layers=3)
    with pytest.raises(ValueError) as error:
        build_plan(dims, LayoutPair(train_tp=8, train_pp=2, rollout_tp=3))
    message = str(error.value)
    assert "train TP=8" in message and "num_key_value_heads=4" in message
    assert "train PP=2" in message and "num_hidden_layers=3" in message
    assert "rollout TP=3" in message and "num_attention_heads=8" in message
    with pytest.raises(ValueError, match="bucket_mb=0"):
        build_plan(dims_of("qwen2"), LayoutPair(1, 1, 1), bucket_mb=0)
