"""Megatron ⇄ HF layout: names with PP offsets, TP split/merge of every parameter kind."""

import dataclasses

import pytest
import torch

from megarl.models import layout
from megarl.models.hf_config import ModelDims

DIMS = ModelDims(
    model_type="qwen2",
    vocab_size=100,
    hidden_size=16,
    ffn_hidden_size=24,
    num_layers=4,
    num_attention_heads=8,
    num_kv_heads=4,
    head_dim=4,
    qkv_bias=True,
    qk_layernorm=True,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    rope_scaling=None,
    max_position_embeddings=64,
    initializer_range=0.02,
    attention_dropout=0.0,
)

LAYER_PARAMS = [
    "input_layernorm.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight",
    "self_attention.k_layernorm.weight",
    "self_attention.linear_proj.weight",
    "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
]
GLOBAL_PARAMS = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]


def _hf_tensors(dims: ModelDims) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in layout.hf_param_shapes(dims).items()}


def _megatron_names(dims: ModelDims, pp_size: int):
    """(pp_rank, stage-local name, layer offset) of every Megatron parameter."""
    per_stage = dims.num_layers // pp_size
    for pp_rank in range(pp_size):
        offset = layout.layer_offset(dims.num_layers, pp_size, pp_rank)
        names = [f"decoder.layers.{i}.{p}" for i in range(per_stage) for p in LAYER_PARAMS]
        if pp_rank == 0:
            names.append("embedding.word_embeddings.weight")
        if pp_rank == pp_size - 1:
            names += ["decoder.final_layernorm.weight", "output_layer.weight"]
        for name in names:
            yield pp_rank, name, offset


@pytest.mark.parametrize("tp_size,pp_size", [(1, 1), (2, 2), (4, 1), (2, 4)])
def test_split_then_merge_restores_every_hf_tensor(tp_size, pp_size):
    hf = _hf_tensors(DIMS)
    restored = {}
    for _, name, offset in _megatron_names(DIMS, pp_size):
        mapping = layout.param_mapping(name, DIMS, layer_offset=offset)
        shards = layout.tp_shards_from_hf(mapping, hf, DIMS, tp_size=tp_size, vocab_divisible_by=8)
        assert len({s.shape for s in shards}) == 1, f"{name}: TP shards differ in shape"
        for hf_name, tensor in layout.megatron_to_hf(name, shards, DIMS, layer_offset=offset):
            assert hf_name not in restored, f"{hf_name} produced twice"
            restored[hf_name] = tensor
    assert restored.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(restored[name], tensor), name


def test_qkv_shards_hold_whole_kv_groups_interleaved():
    # head_dim 1, hidden 1: every row is labelled by its head. 8 q heads, 4 KV groups, 2 groups per rank.
    dims = dataclasses.replace(DIMS, head_dim=1, hidden_size=1)
    hf = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(8.0)[:, None],
        "model.layers.0.self_attn.k_proj.weight": 100 + torch.arange(4.0)[:, None],
        "model.layers.0.self_attn.v_proj.weight": 200 + torch.arange(4.0)[:, None],
    }
    mapping = layout.param_mapping("decoder.layers.0.self_attention.linear_qkv.weight", dims)
    shards = layout.tp_shards_from_hf(mapping, hf, dims, tp_size=2, vocab_divisible_by=1)
    assert shards[0].flatten().tolist() == [0, 1, 100, 200, 2, 3, 101, 201]
    assert shards[1].flatten().tolist() == [4, 5, 102, 202, 6, 7, 103, 203]


def test_gate_up_shard_is_gate_then_up_of_the_rank():
    dims = dataclasses.replace(DIMS, ffn_hidden_size=4, hidden_size=1)
    hf = {
        "model.layers.0.mlp.gate_proj.weight": torch.arange(4.0)[:, None],
        "model.layers.0.mlp.up_proj.weight": 10 + torch.arange(4.0)[:, None],
    }
    mapping = layout.param_mapping("decoder.layers.0.mlp.linear_fc1.weight", dims)
    shards = layout.tp_shards_from_hf(mapping, hf, dims, tp_size=2, vocab_divisible_by=1)
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]


def test_row_parallel_splits_columns():
    hf = _hf_tensors(DIMS)
    o_proj = hf["model.layers.1.self_attn.o_proj.weight"]
    mapping = layout.param_mapping("decoder.layers.1.self_attention.linear_proj.weight", DIMS)
    shards = layout.tp_shards_from_hf(mapping, hf, DIMS, tp_size=4, vocab_divisible_by=1)
    assert all(torch.equal(s, o_proj[:, 8 * r : 8 * (r + 1)]) for r, s in enumerate(shards))


def test_vocab_is_padded_with_zero_rows_and_trimmed_back():
    assert layout.padded_vocab_size(100, 128, 1) == 128
    assert layout.padded_vocab_size(100, 128, 2) == 256
    assert layout.padded_vocab_size(256, 128, 2) == 256
    hf = _hf_tensors(DIMS)
    mapping = layout.param_mapping("embedding.word_embeddings.weight", DIMS)
    shards = layout.tp_shards_from_hf(mapping, hf, DIMS, tp_size=2, vocab_divisible_by=64)
    assert [s.shape[0] for s in shards] == [64, 64]
    assert torch.equal(shards[0], hf["model.embed_tokens.weight"][:64])
    assert torch.equal(shards[1][:36], hf["model.embed_tokens.weight"][64:])
    assert not shards[1][36:].any(), "padding rows must be zero"
    [(name, merged)] = layout.merge_tp_shards(mapping, shards, DIMS)
    assert name == "model.embed_tokens.weight" and torch.equal(merged, hf[name])


def test_names_add_the_stage_layer_offset():
    assert layout.layer_offset(8, 4, 3) == 6
    mapping = layout.param_mapping("decoder.layers.1.mlp.linear_fc1.weight", DIMS, layer_offset=6)
    assert mapping.hf_names == ("model.layers.7.mlp.gate_proj.weight", "model.layers.7.mlp.up_proj.weight")
    assert mapping.kind == layout.GATE_UP
    qkv = layout.param_mapping("decoder.layers.0.self_attention.linear_qkv.bias", DIMS, layer_offset=2)
    assert qkv.hf_names == tuple(f"model.layers.2.self_attn.{p}_proj.bias" for p in "qkv")
    with pytest.raises(ValueError, match="num_hidden_layers=6 is not divisible by pipeline parallel size 4"):
        layout.layer_offset(6, 4, 1)


@pytest.mark.parametrize("layers, pp, vpp", [(8, 2, 2), (12, 2, 3), (16, 4, 2), (8, 4, 1)])
def test_virtual_stage_offsets_are_megatrons(layers, pp, vpp):
    """Chunk v of rank r starts where megatron-core's own `get_transformer_layer_offset` puts it."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=8,
        num_attention_heads=2,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    for rank in range(pp):
        for stage in range(vpp):
            expected = get_transformer_layer_offset(config, vp_stage=stage if vpp > 1 else None, pp_rank=rank)
            assert layout.layer_offset(layers, pp, rank, vpp, stage) == expected, (rank, stage)
    with pytest.raises(ValueError, match=f"pipeline parallel size {pp} × virtual pipeline size {layers}"):
        layout.layer_offset(layers, pp, 0, layers, 0)


def test_transformer_engine_fused_norm_names_map_like_local_ones():
    te = layout.param_mapping("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", DIMS)
    local = layout.param_mapping("decoder.layers.0.input_layernorm.weight", DIMS)
    assert te.hf_names == local.hf_names == ("model.layers.0.input_layernorm.weight",)
    te_mlp = layout.param_mapping("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", DIMS)
    assert te_mlp.hf_names == ("model.layers.3.post_attention_layernorm.weight",)


def test_tied_output_layer_maps_to_the_embedding():
    tied = dataclasses.replace(DIMS, tie_word_embeddings=True)
    assert layout.param_mapping("output_layer.weight", tied).hf_names == ("model.embed_tokens.weight",)
    assert layout.param_mapping("output_layer.weight", DIMS).hf_names == ("lm_head.weight",)
    assert "lm_head.weight" not in layout.hf_param_shapes(tied)


def test_unknown_names_and_indivisible_kv_groups_are_errors():
    with pytest.raises(ValueError, match="decoder.layers.0.self_attention.core_attention.foo"):
        layout.param_mapping("decoder.layers.0.self_attention.core_attention.foo", DIMS)
    mapping = layout.param_mapping("decoder.layers.0.self_attention.linear_qkv.weight", DIMS)
    with pytest.raises(ValueError, match="num_key_value_heads=4 is not divisible by tensor parallel size 8"):
        layout.tp_shards_from_hf(mapping, _hf_tensors(DIMS), DIMS, tp_size=8, vocab_divisible_by=1)


@pytest.mark.parametrize("pp_size", [1, 2, 4])
def test_hf_names_map_back_to_the_owning_stage_and_parameter(pp_size):
    for hf_name in layout.hf_param_shapes(DIMS):
        stage, megatron_name = layout.megatron_name_of(hf_name, DIMS, pp_size=pp_size)
        offset = layout.layer_offset(DIMS.num_layers, pp_size, stage)
        assert hf_name in layout.param_mapping(megatron_name, DIMS, layer_offset=offset).hf_names
    assert layout.megatron_name_of("model.layers.3.self_attn.k_proj.weight", DIMS, pp_size=2) == (
        1,
        "decoder.layers.1.self_attention.linear_qkv.weight",
    )
    with pytest.raises(ValueError, match="'model.layers.0.mlp.experts.0.w1' has no Megatron counterpart"):
        layout.megatron_name_of("model.layers.0.mlp.experts.0.w1", DIMS, pp_size=1)
