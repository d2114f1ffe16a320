"""HF config.json → ModelDims: each architecture, both RoPE layouts, every unsupported feature."""

import pytest

from megarl.models.hf_config import RopeScaling, check_parallel_layout, read_model_dims

BASE = {
    "vocab_size": 100,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
}


def config(model_type, **fields):
    return {**BASE, "model_type": model_type, **fields}


def test_llama_gqa_untied_by_default():
    dims = read_model_dims(config("llama"))
    assert (dims.num_kv_heads, dims.head_dim, dims.heads_per_group) == (2, 16, 4)
    assert not dims.qkv_bias and not dims.qk_layernorm and not dims.tie_word_embeddings
    assert (dims.q_size, dims.kv_size) == (128, 32)


def test_qwen2_has_qkv_bias_and_may_tie_embeddings():
    dims = read_model_dims(config("qwen2", tie_word_embeddings=True, use_sliding_window=False))
    assert dims.qkv_bias and not dims.qk_layernorm and dims.tie_word_embeddings


def test_qwen3_has_qk_norm_and_its_own_head_dim():
    dims = read_model_dims(config("qwen3", head_dim=64))
    assert dims.qk_layernorm and not dims.qkv_bias
    assert (dims.head_dim, dims.q_size, dims.kv_size) == (64, 512, 128)


def test_missing_kv_heads_means_multi_head_attention():
    cfg = config("llama")
    del cfg["num_key_value_heads"]
    assert read_model_dims(cfg).num_kv_heads == 8


def test_rope_from_transformers_v5_rope_parameters():
    cfg = config("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    del cfg["rope_theta"]
    dims = read_model_dims(cfg)
    assert dims.rope_theta == 1e6 and dims.rope_scaling is None


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_llama3_rope_scaling_with_megatrons_fixed_factors(key):
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = config("llama", **{key: {**scaling, "rope_theta": 5e5} if key == "rope_parameters" else scaling})
    assert read_model_dims(cfg).rope_scaling == RopeScaling("llama3", 32.0)
    scaling["high_freq_factor"] = 2.0
    with pytest.raises(ValueError, match=f"{key} llama3 .*high_freq_factor"):
        read_model_dims(config("llama", **{key: {**scaling, "rope_theta": 5e5}}))


def test_linear_rope_scaling_and_unsupported_rope_types():
    assert read_model_dims(config("llama", rope_scaling={"type": "linear", "factor": 2.0})).rope_scaling == RopeScaling(
        "linear", 2.0
    )
    with pytest.raises(ValueError, match="rope_scaling rope_type='yarn' is not supported"):
        read_model_dims(config("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}))


@pytest.mark.parametrize(
    "model_type,fields,message",
    [
        ("mistral", {}, "model_type='mistral' is not supported"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=true"),
        (
            "qwen3",
            {"layer_types": ["full_attention", "sliding_attention"]},
            "layer_types contains \\['sliding_attention'\\]",
        ),
        ("qwen2", {"num_experts": 8}, "num_experts=8 .*mixture-of-experts"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"attention_bias": True}, "attention_bias=true for model_type='llama'"),
        ("qwen3", {"attention_bias": True}, "attention_bias=true for model_type='qwen3'"),
        ("llama", {"mlp_bias": True}, "mlp_bias=true"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 \\(RoPE over part of a head"),
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
            "rope_parameters.partial_rotary_factor=0.25",
        ),
        ("llama", {"num_key_value_heads": 3}, "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
        ("llama", {"vocab_size": None}, "required key 'vocab_size' is missing"),
    ],
)
def test_unsupported_configs_name_the_key(model_type, fields, message):
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        read_model_dims(config(model_type, **fields))


def test_parallel_layouts_the_model_cannot_be_cut_into():
    dims = read_model_dims(config("llama"))
    check_parallel_layout(dims, tp_size=2, pp_size=4)
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide num_key_value_heads=2"):
        check_parallel_layout(dims, tp_size=4, pp_size=1)
    with pytest.raises(ValueError, match="pipeline parallel size 3 does not divide num_hidden_layers=4"):
        check_parallel_layout(dims, tp_size=1, pp_size=3)
    check_parallel_layout(dims, tp_size=1, pp_size=2, vpp_size=2)
    with pytest.raises(
        ValueError, match="pipeline parallel size 2 × virtual pipeline size 4 does not divide num_hidden_layers=4"
    ):
        check_parallel_layout(dims, tp_size=1, pp_size=2, vpp_size=4)
