"""HF dims → megatron-core TransformerConfig and layer spec (no processes: configs and specs only)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from megarl.models.architectures import (
    TE_SELF_ATTENTION_MASK_TYPE,
    layer_spec,
    resolve_transformer_impl,
    takes_thd,
    transformer_config,
)
from megarl.models.hf_config import read_model_dims

BASE = {
    "vocab_size": 100,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "initializer_range": 0.05,
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
    assert cfg.params_dtype == torch.float32 and not cfg.bf16 and cfg.transformer_impl == "local"
    assert cfg.use_cpu_initialization == (not torch.cuda.is_available())


def test_qwen3_local_spec_has_qk_layernorm():
    from megatron.core.transformer.identity_op import IdentityOp

    qwen3 = layer_spec(dims_of("qwen3")).submodules.self_attention.submodules
    llama = layer_spec(dims_of("llama")).submodules.self_attention.submodules
    assert qwen3.q_layernorm is not IdentityOp and qwen3.k_layernorm is not IdentityOp
    assert llama.q_layernorm in (None, IdentityOp)


def test_overrides_are_for_non_architectural_fields_only():
    dims = dims_of("llama")
    cfg = transformer_config(dims, tp_size=1, pp_size=1, params_dtype=torch.bfloat16, sequence_parallel=False)
    assert cfg.bf16 and not cfg.fp16 and cfg.params_dtype == cfg.pipeline_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\['num_query_groups'\] come from the HF config.json"):
        transformer_config(dims, tp_size=1, pp_size=1, num_query_groups=8)
    with pytest.raises(ValueError, match=r"\['bf16'\] come from the HF config.json, params_dtype or transformer_impl"):
        transformer_config(dims, tp_size=1, pp_size=1, bf16=True)
    with pytest.raises(ValueError, match=r"\['apply_rope_fusion', 'rotary_interleaved'\] come from"):
        transformer_config(dims, tp_size=1, pp_size=1, apply_rope_fusion=True, rotary_interleaved=True)


def test_float16_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="model.dtype.*use model.dtype: bfloat16"):
        transformer_config(dims_of("llama"), tp_size=1, pp_size=1, params_dtype=torch.float16)


def test_auto_resolves_to_transformer_engine_only_on_cuda_with_it_installed(monkeypatch):
    from megarl.models import architectures

    assert resolve_transformer_impl("local", "cuda", "bfloat16") == "local"
    for installed, on_cuda in ((False, "local"), (True, "transformer_engine")):
        monkeypatch.setattr(architectures, "_te_importable", lambda installed=installed: installed)
        assert resolve_transformer_impl("auto", "cuda", "bfloat16") == on_cuda
        assert resolve_transformer_impl("auto", "cpu", "bfloat16") == "local"


def test_float32_never_gets_the_transformer_engine_spec(monkeypatch):
    """TE's spec takes THD micro-batches, for which TE has no float32 attention (its backend selection
    drops the unfused backend for thd; flash and fused take fp16/bf16): the fp32 quickstart on a GPU
    with TE installed gets the local spec (an explicit TE spec in fp32 is refused by validate: the catalogue's
    te-spec-in-float32 case)."""
    from megarl.models import architectures

    monkeypatch.setattr(architectures, "_te_importable", lambda: True)
    assert resolve_transformer_impl("auto", "cuda", "float32") == "local"
    assert resolve_transformer_impl("auto", "cuda", "bfloat16") == "transformer_engine"


def test_transformer_engine_spec_is_causal_for_thd(monkeypatch):
    """The TE spec's self-attention gets `causal` (TEDotProductAttention turns it into
    `padding_causal` for THD micro-batches) and takes THD micro-batches; the local spec keeps a
    dense mask. TE is CUDA-only, so its spec function is stood in for by the local one, whose
    self-attention entry has the same form (checked against the installed source below), and its
    fused RoPE, which the TE config needs to exist (tests/unit/gpu_contracts/
    test_megatron_rope_fusion_contract.py), by a function never called here."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.models import architectures

    monkeypatch.setattr(architectures, "_te_importable", lambda: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *args, **kwargs: None)
    monkeypatch.setattr(
        architectures,
        "get_gpt_layer_with_transformer_engine_spec",
        lambda qk_layernorm: get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm"),
    )
    assert AttnMaskType.causal == TE_SELF_ATTENTION_MASK_TYPE
    te_attention = layer_spec(dims_of("qwen3"), "transformer_engine").submodules.self_attention
    assert te_attention.params["attn_mask_type"] == AttnMaskType.causal
    assert te_attention.submodules.q_layernorm is not None  # the rest of the spec is untouched
    # The local spec keeps causal: its softmax uses a given mask as is (None: causal).
    local_attention = layer_spec(dims_of("qwen3")).submodules.self_attention
    assert local_attention.params["attn_mask_type"] == AttnMaskType.causal
    dims = dims_of("qwen2")
    assert takes_thd(transformer_config(dims, tp_size=1, pp_size=1, transformer_impl="transformer_engine"))
    assert not takes_thd(transformer_config(dims, tp_size=1, pp_size=1))


def _megatron_source(module: str) -> str:
    """Source of an installed megatron-core module, read as text (the TE modules need TE to import)."""
    from pathlib import Path

    return Path(importlib.util.find_spec(module).origin).read_text()


def test_transformer_engine_contract_the_mask_type_relies_on():
    """Signature test against megatron-core 0.16.1 without Transformer Engine (it is CUDA-only):
    - gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec builds the self-attention as a
      `ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal}, ...)`, the
      entry `with_self_attention_mask_type` replaces (as for the local spec, tested above);
    - extensions/transformer_engine.TEDotProductAttention.forward turns `causal` into
      `padding_causal` for `qkv_format == "thd"` and hands TE that type's name and the
      `PackedSeqParams` fields as keywords.
    """
    import inspect
    import re

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec_source = inspect.getsource(get_gpt_layer_with_transformer_engine_spec)
    assert re.search(r'module=SelfAttention,\s*params=\{"attn_mask_type": AttnMaskType.causal\}', spec_source)
    te = _megatron_source("megatron.core.extensions.transformer_engine")
    forward = te[te.index("class TEDotProductAttention") :]
    forward = forward[forward.index("    def forward(") :]
    forward = forward[: forward.index("\n    def ", 10)]
    assert re.search(
        r'if qkv_format == "thd".*?\n\s*if attn_mask_type == AttnMaskType.causal:'
        r"\n\s*attn_mask_type = AttnMaskType.padding_causal",
        forward,
        re.DOTALL,
    )
    assert "attn_mask_type=attn_mask_type.name, **attention_bias_kwargs, **packed_seq_kwargs" in forward
    assert "super().forward(query, key, value, attention_mask, **_fa_kwargs)" in forward


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
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
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

    hf_config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=32,
        intermediate_size=256,
        max_position_embeddings=16384,
        rope_parameters=rope_parameters,
    )
    dims = read_model_dims(hf_config)
    rotary = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, use_cpu_initialization=True, **rope_arguments(dims))
    positions = 9000
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](hf_config, "cpu")
    hf_angles = torch.outer(torch.arange(positions, dtype=torch.float32), hf_inv_freq.float())
    torch.testing.assert_close(rotary.get_freqs_non_repeated(positions), hf_angles, rtol=1e-5, atol=1e-3)
