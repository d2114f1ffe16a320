"""The dense decoder family (Llama, Qwen2/2.5, Qwen3): one Megatron GPT shape with switches.

RMSNorm, SwiGLU (`gated_linear_unit` + silu), GQA (`num_query_groups`), RoPE, optional q/k/v biases
(Qwen2), optional per-head q/k RMSNorm (Qwen3, whose `head_dim` may differ from hidden / heads),
tied or untied embeddings. An architecture module of the family is a `DenseDecoder` with its
switches and its transformers config class:

    ARCHITECTURE = DenseDecoder("qwen3", qkv_bias=False, qk_layernorm=True, hf_config_class="Qwen3Config")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megarl.models.arch import GATE_UP, QKV, REPLICATED, ROW, Architecture, LayerParam
from megarl.models.hf_config import ModelDims, read_number, read_positive_int, read_rope


@dataclass(frozen=True)
class DenseDecoder(Architecture):
    """One architecture of the dense family."""

    model_type: str
    """HF `model_type`."""
    qkv_bias: bool
    """q/k/v projections carry biases (an architecture fact, not a config.json key)."""
    qk_layernorm: bool
    """A per-head RMSNorm on q and k before RoPE (`q_norm` / `k_norm`)."""
    hf_config_class: str
    """The transformers config class of `tiny_config`, e.g. "Qwen3Config"."""
    tiny_fields: Callable[[dict[str, Any]], dict[str, Any]] = field(default=dict)
    """The architecture's changes to the tiny model's config fields (a copy of them is passed)."""

    def read_dims(self, cfg: Mapping[str, Any]) -> ModelDims:
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if cfg.get(key):
                raise ValueError(
                    f"config.json: unsupported {key}={cfg[key]} for model_type={cfg['model_type']!r} "
                    "(a dense architecture; megarl builds mixture-of-experts as model_type 'qwen3_moe')"
                )
        return self.read_shared_dims(cfg)

    def read_shared_dims(self, cfg: Mapping[str, Any]) -> ModelDims:
        """The dims every decoder of the family reads (attention, sizes, RoPE, norms), MoE fields at 0."""
        _reject_unsupported_features(cfg)
        num_heads = read_positive_int(cfg, "num_attention_heads")
        hidden = read_positive_int(cfg, "hidden_size")
        # Older Llama configs omit num_key_value_heads (= MHA); Qwen2 has no head_dim key (= hidden / heads).
        num_kv_heads = read_positive_int(cfg, "num_key_value_heads", default=num_heads)
        head_dim = read_positive_int(cfg, "head_dim", default=hidden // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        rope_theta, rope_scaling = read_rope(cfg)
        return ModelDims(
            model_type=self.model_type,
            vocab_size=read_positive_int(cfg, "vocab_size"),
            hidden_size=hidden,
            ffn_hidden_size=read_positive_int(cfg, "intermediate_size"),
            num_layers=read_positive_int(cfg, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_layernorm,
            # Llama, Qwen2 and Qwen3 config classes all default to untied embeddings.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rms_norm_eps=read_number(cfg, "rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=read_positive_int(cfg, "max_position_embeddings"),
            initializer_range=read_number(cfg, "initializer_range", default=0.02),
            attention_dropout=read_number(cfg, "attention_dropout", default=0.0),
        )

    def transformer_fields(self, dims: ModelDims) -> dict[str, Any]:
        import torch.nn.functional as F

        return dict(
            num_layers=dims.num_layers,
            hidden_size=dims.hidden_size,
            ffn_hidden_size=dims.ffn_hidden_size,
            num_attention_heads=dims.num_attention_heads,
            num_query_groups=dims.num_kv_heads,
            kv_channels=dims.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=dims.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=dims.qkv_bias,
            qk_layernorm=dims.qk_layernorm,
            hidden_dropout=0.0,
            attention_dropout=dims.attention_dropout,
            init_method_std=dims.initializer_range,
            # HF Llama/Qwen rotate halves (`rotate_half`), not interleaved pairs; `rope_fusion` relies on it.
            rotary_interleaved=False,
        )

    def layer_spec_options(self, dims: ModelDims, transformer_impl: str) -> dict[str, Any]:
        options = {"qk_layernorm": dims.qk_layernorm}
        # The local spec picks its norm class from this argument; TE's norms read the TransformerConfig.
        return options | {"normalization": "RMSNorm"} if transformer_impl == "local" else options

    def layer_params(self, dims: ModelDims) -> tuple[LayerParam, ...]:
        return (
            *self.attention_params(dims),
            LayerParam("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP),
            LayerParam("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ROW),
        )

    def attention_params(self, dims: ModelDims) -> tuple[LayerParam, ...]:
        """The layer's parameters before its MLP: norms, attention and the pre-MLP norm, in model order."""
        params = [
            LayerParam("input_layernorm.weight", ("input_layernorm.weight",), REPLICATED),
            LayerParam(
                "self_attention.linear_qkv.weight",
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                QKV,
            ),
        ]
        if dims.qkv_bias:
            params.append(
                LayerParam(
                    "self_attention.linear_qkv.bias",
                    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                    QKV,
                )
            )
        if dims.qk_layernorm:
            params += [
                LayerParam("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), REPLICATED),
                LayerParam("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), REPLICATED),
            ]
        return (
            *params,
            LayerParam("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), ROW),
            LayerParam("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REPLICATED),
        )

    def hf_layer_shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        h, f = dims.hidden_size, dims.ffn_hidden_size
        return self.hf_attention_shapes(dims) | {
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }

    def hf_attention_shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        """The HF tensors of `attention_params` with their shapes."""
        h = dims.hidden_size
        shapes = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (dims.q_size, h),
            "self_attn.k_proj.weight": (dims.kv_size, h),
            "self_attn.v_proj.weight": (dims.kv_size, h),
            "self_attn.o_proj.weight": (h, dims.q_size),
        }
        if dims.qkv_bias:
            shapes |= {
                "self_attn.q_proj.bias": (dims.q_size,),
                "self_attn.k_proj.bias": (dims.kv_size,),
                "self_attn.v_proj.bias": (dims.kv_size,),
            }
        if dims.qk_layernorm:
            shapes |= {"self_attn.q_norm.weight": (dims.head_dim,), "self_attn.k_norm.weight": (dims.head_dim,)}
        return shapes

    def layer_parameters(self, dims, tp: int) -> int:
        return layer_parameters(dims, tp)

    def forward_flops_per_token(self, dims: ModelDims, sequence_length: int) -> int:
        """`megarl.models.flops` explains the count (matmuls only, PaLM / Megatron-LM convention)."""
        h = dims.hidden_size
        mlp = 2 * 3 * h * dims.ffn_hidden_size
        return dims.num_layers * (attention_flops_per_token(dims, sequence_length) + mlp) + 2 * h * dims.vocab_size

    def tiny_config(self, fields: dict[str, Any]) -> Any:
        import transformers

        return getattr(transformers, self.hf_config_class)(**self.tiny_fields(dict(fields)))


def attention_flops_per_token(dims: ModelDims, sequence_length: int) -> int:
    """One layer's attention matmul FLOPs per token: the q/k/v/o projections and the score and value
    products over `sequence_length` keys."""
    h = dims.hidden_size
    projections = 2 * h * (dims.q_size + 2 * dims.kv_size) + 2 * dims.q_size * h
    return projections + 2 * 2 * dims.q_size * sequence_length


def layer_parameters(dims: ModelDims, tp: int, ep: int = 1, etp: int | None = None) -> int:
    """Parameters of one decoder layer of the family on one rank of a TP × EP × expert-TP grid: with
    `dims.num_experts` > 0 (Qwen3-MoE) the router (replicated) and this rank's E / EP experts, each cut
    over `etp` (None: `tp`)."""
    h = dims.hidden_size
    if dims.num_experts:
        router = dims.num_experts * h
        return attention_parameters(dims, tp) + router + expert_parameters(dims, ep, tp if etp is None else etp)
    return attention_parameters(dims, tp) + 3 * h * dims.ffn_hidden_size // tp


def expert_parameters(dims: ModelDims, ep: int, etp: int) -> int:
    """Parameters of one layer's experts on one rank: E / EP SwiGLU experts, each cut over `etp`; 0
    for a dense model."""
    return dims.num_experts // ep * 3 * dims.hidden_size * dims.moe_ffn_hidden_size // etp


def attention_parameters(dims: ModelDims, tp: int) -> int:
    """Parameters of one layer's `attention_params` (both norms included) on one TP rank."""
    h, q, kv = dims.hidden_size, dims.num_attention_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    qkv_rows = q + 2 * kv
    sharded = h * qkv_rows + (qkv_rows if dims.qkv_bias else 0) + q * h
    replicated = 2 * h + (2 * dims.head_dim if dims.qk_layernorm else 0)
    return sharded // tp + replicated


def _reject_unsupported_features(cfg: Mapping[str, Any]) -> None:
    """Features the Megatron model would silently get wrong; each names its key."""
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (megarl supports 'silu', i.e. SwiGLU)")
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window=true (sliding-window attention is not supported; set it to false)")
    layer_types = cfg.get("layer_types") or []
    if not isinstance(layer_types, list):
        problems.append(f"layer_types={layer_types!r} (expected a list of 'full_attention')")
        layer_types = []
    non_full = sorted({str(t) for t in layer_types if t != "full_attention"})
    if non_full:
        problems.append(f"layer_types contains {non_full} (only 'full_attention' layers are supported)")
    if cfg.get("attention_bias"):
        # Llama/Qwen3 attention_bias puts a bias on o_proj too; Megatron's add_qkv_bias covers q/k/v only.
        problems.append(
            f"attention_bias=true for model_type={cfg['model_type']!r} (biases on q/k/v/o are not supported; "
            "only Qwen2's built-in q/k/v biases are)"
        )
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=true (MLP biases are not supported)")
    rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    for key, holder in (("partial_rotary_factor", cfg), ("rope_parameters.partial_rotary_factor", rope_params)):
        if holder.get("partial_rotary_factor", 1.0) != 1.0:
            # Megatron would rotate only part of each head; HF's Llama/Qwen attention rotates whole heads.
            problems.append(
                f"{key}={holder['partial_rotary_factor']} (RoPE over part of a head is not supported; "
                "Llama and Qwen rotate whole heads)"
            )
    if problems:
        raise ValueError("config.json: unsupported " + "; ".join(problems))
