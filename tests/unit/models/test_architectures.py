"""HF dims → megatron-core TransformerConfig and layer spec (no processes: configs and specs only)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from megarl.models.architectures import layer_spec, transformer_config
from megarl.models.hf_config import read_model_dims

BASE = {
    "vocab_size": 100, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
    "hidden_act": "silu", "rope_theta": 10000.0, "initializer_range": 0.05,
}


def dims_of(model_type, **fields):
    return read_model_dims({**BASE, "model_type": model_type, **fields})


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_transformer_config_carries_the_architecture(model_type):
    dims = dims_of(model_type, head_dim=32)
    cfg = transformer_config(dims, tp_size=2, pp_size=2)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 128, 256)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (8, 4, 32)
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5
    assert cfg.gated_linear_unit and cfg.activation_func is F.silu and not cfg.add_bias_linear
    assert cfg.add_qkv_bias == (model_type == "qwen2")
    assert cfg.qk_layernorm == (model_type == "qwen3")
    assert cfg.hidden_dropout == 0.0 and cfg.init_method_std == 0.05
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    assert cfg.params_dtype == torch.float32 and cfg.transformer_impl == "local"
    assert cfg.use_cpu_initialization == (not torch.cuda.is_available())


def test_qwen3_local_spec_has_qk_layernorm():
    from megatron.core.transformer.identity_op import IdentityOp

    qwen3 = layer_spec(dims_of("qwen3")).submodules.self_attention.submodules
    llama = layer_spec(dims_of("llama")).submodules.self_attention.submodules
    assert qwen3.q_layernorm is not IdentityOp and qwen3.k_layernorm is not IdentityOp
    assert llama.q_layernorm in (None, IdentityOp)


def test_overrides_are_for_non_architectural_fields_only():
    dims = dims_of("llama")
    cfg = transformer_config(dims, tp_size=1, pp_size=1, params_dtype=torch.bfloat16, bf16=True)
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\['num_query_groups'\] come from the HF config.json"):
        transformer_config(dims, tp_size=1, pp_size=1, num_query_groups=8)


def test_bad_impl_and_layout_are_rejected():
    dims = dims_of("qwen2")
    with pytest.raises(ValueError, match="transformer_impl='fast' is not one of"):
        transformer_config(dims, tp_size=1, pp_size=1, transformer_impl="fast")
    with pytest.raises(ValueError, match="tensor parallel size 8 does not divide num_key_value_heads=4"):
        transformer_config(dims, tp_size=8, pp_size=1)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine installed")
def test_transformer_engine_without_it_says_to_use_local():
    with pytest.raises(ValueError, match="use transformer_impl='local' on CPU"):
        layer_spec(dims_of("qwen2"), "transformer_engine")


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ],
    ids=["llama3", "linear"],
)
def test_rope_scaling_gives_hf_frequencies(rope_parameters):
    """Megatron's rotation angles per position equal transformers' for the same config.json."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megarl.models.architectures import rope_arguments

    hf_config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32, intermediate_size=256,
                            max_position_embeddings=16384, rope_parameters=rope_parameters)
    dims = read_model_dims(hf_config)
    rotary = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, use_cpu_initialization=True, **rope_arguments(dims))
    positions = 9000
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](hf_config, "cpu")
    hf_angles = torch.outer(torch.arange(positions, dtype=torch.float32), hf_inv_freq.float())
    torch.testing.assert_close(rotary.get_freqs_non_repeated(positions), hf_angles, rtol=1e-5, atol=1e-3)
