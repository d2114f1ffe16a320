"""A single-process stand-in for the trainer world: every rank's shards of an HF state dict, and
the buckets the bridge would send from them (the same conversion calls as `collect`, no gloo)."""

from __future__ import annotations

import math

import torch

from megarl.bridge.convert import to_hf
from megarl.bridge.plan import SyncPlan
from megarl.models.hf_config import read_model_dims
from megarl.models.layout import GATE_UP, hf_param_shapes, merge_tp_shards_into, param_mapping, tp_shards_from_hf

VOCAB_DIVISIBLE_BY = 128

CONFIGS = {
    # GQA with 2 KV groups per TP-2 rank, untied, q/k/v biases.
    "qwen2": dict(
        model_type="qwen2", hidden_size=256, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False
    ),
    # Tied embeddings (no lm_head), GQA.
    "llama": dict(
        model_type="llama",
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    # Qwen3's attention with 8 routed experts (top-2) of width 64 in every layer.
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    # q/k norms, one KV head per query head (MHA).
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=False,
    ),
}


def dims_of(arch: str, **overrides):
    config = dict(
        vocab_size=100,
        intermediate_size=384,
        num_hidden_layers=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    config.update(CONFIGS[arch], **overrides)
    return read_model_dims(config)


def random_hf_tensors(dims, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in hf_param_shapes(dims).items()}


def megatron_shards(plan: SyncPlan, hf_tensors) -> dict[str, list[torch.Tensor]]:
    """Plan Megatron name -> its TP shards (rank order; an expert's: expert-TP), as the checkpoint loader makes them."""
    return {
        p.megatron_name: tp_shards_from_hf(
            param_mapping(p.megatron_name, plan.dims),
            hf_tensors,
            plan.dims,
            tp_size=plan.layout.expert_tp if p.expert >= 0 else plan.layout.train_tp,
            vocab_divisible_by=VOCAB_DIVISIBLE_BY,
        )
        for p in plan.params
    }


def stage_ranks(layout):
    """The grid coordinates of every rank of one stage (`ProcessGroups`' fields the bridge reads), in
    megatron's rank order tp-cp-ep-dp-pp: rank i is TP rank i % TP of DP replica i // TP, and expert-TP
    rank i % ETP of EP rank i // ETP % EP in expert-DP replica i // (ETP · EP); the fewest ranks both
    grids fit."""
    etp, ep = layout.expert_tp, layout.train_ep
    return [
        dict(
            tp_size=layout.train_tp,
            tp_rank=i % layout.train_tp,
            dp_rank=i // layout.train_tp,
            etp_size=etp,
            etp_rank=i % etp,
            ep_size=ep,
            ep_rank=i // etp % ep,
            expert_dp_rank=i // (etp * ep),
        )
        for i in range(math.lcm(layout.train_tp, etp * ep))
    ]


def emulated_buckets(plan: SyncPlan, shards) -> list[tuple[torch.Tensor, object]]:
    """Each bucket's flat buffer, NaN where nothing was written."""
    buckets = []
    for bucket in plan.buckets:
        flat = torch.full((bucket.metadata.numel,), float("nan"), dtype=bucket.metadata.dtype)
        slots = iter(bucket.metadata.slots)
        for param in bucket.params:
            param_shards = shards[param.megatron_name] if param.needs_tp_gather else shards[param.megatron_name][:1]
            for name, tensor in to_hf(param, param_shards, plan.dims):
                slot = next(slots)
                assert slot.name == name
                flat[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
        buckets.append((flat, bucket.metadata))
    return buckets


def naive_gate_up_merge_into(mapping, shards, dims, outs):
    """The classic bug: treat the concatenated TP shards as [gate; up]."""
    if mapping.kind != GATE_UP:
        return merge_tp_shards_into(mapping, shards, dims, outs)
    gate, up = torch.cat(list(shards)).chunk(2)
    outs[0].copy_(gate)
    outs[1].copy_(up)
