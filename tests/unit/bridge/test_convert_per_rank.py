"""The per-rank regroup for equal train and rollout TP: a Megatron shard becomes exactly the rows
vLLM rank r holds, computed here independently from the full HF tensors the way vLLM's
`QKVParallelLinear` / `MergedColumnParallelLinear` / `RowParallelLinear` loaders narrow them."""

from __future__ import annotations

import pytest
import torch
from bridge_emulate import dims_of, megatron_shards, random_hf_tensors

from megarl.bridge.convert import to_vllm_rank
from megarl.bridge.plan import LayoutPair, build_plan

LAYER = "model.layers.1."


def vllm_rank_reference(hf, dims, tp, rank):
    """vLLM rank `rank`'s fused tensors of layer 1, by narrowing full HF tensors."""

    def rows(t, r):
        n = t.shape[0] // tp
        return t[r * n : (r + 1) * n]

    attn, mlp = LAYER + "self_attn.", LAYER + "mlp."
    qkv = torch.cat([rows(hf[attn + f"{p}_proj.weight"], rank) for p in "qkv"])
    qkv_bias = torch.cat([rows(hf[attn + f"{p}_proj.bias"], rank) for p in "qkv"]) if dims.qkv_bias else None
    gate_up = torch.cat([rows(hf[mlp + "gate_proj.weight"], rank), rows(hf[mlp + "up_proj.weight"], rank)])
    o_proj = rows(hf[attn + "o_proj.weight"].T, rank).T
    down = rows(hf[mlp + "down_proj.weight"].T, rank).T
    expected = {
        attn + "qkv_proj.weight": qkv,
        mlp + "gate_up_proj.weight": gate_up,
        attn + "o_proj.weight": o_proj,
        mlp + "down_proj.weight": down,
        LAYER + "input_layernorm.weight": hf[LAYER + "input_layernorm.weight"],
    }
    if qkv_bias is not None:
        expected[attn + "qkv_proj.bias"] = qkv_bias
    return expected


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_shard_is_vllms_rank_layout(arch, tp):
    dims = dims_of(arch)
    plan = build_plan(dims, LayoutPair(tp, 1, tp))
    hf = random_hf_tensors(dims)
    shards = megatron_shards(plan, hf)
    layer_params = [p for p in plan.params if p.megatron_name.startswith("decoder.layers.1.")]
    for rank in range(tp):
        got = dict(to_vllm_rank(p, shards[p.megatron_name][rank], dims, tp) for p in layer_params)
        expected = vllm_rank_reference(hf, dims, tp, rank)
        assert got.keys() >= expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (name, rank)


def test_vocabulary_shards_are_refused_with_the_reason():
    dims = dims_of("qwen2")
    plan = build_plan(dims, LayoutPair(2, 1, 2))
    embedding = plan.params[0]
    with pytest.raises(ValueError, match="pad the vocabulary differently"):
        to_vllm_rank(embedding, torch.zeros(128, dims.hidden_size), dims, 2)
