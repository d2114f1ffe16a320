"""Qwen3 (dense): the dense decoder with a per-head RMSNorm on q and k; head_dim may differ from
hidden / heads."""

from megarl.models.arch.dense import DenseDecoder

ARCHITECTURE = DenseDecoder("qwen3", qkv_bias=False, qk_layernorm=True, hf_config_class="Qwen3Config")
