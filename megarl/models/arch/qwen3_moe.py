"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with a routed mixture of experts
in place of every layer's MLP.

Each layer's MLP is a router (`mlp.gate`, `[E, h]`, no bias) choosing `num_experts_per_tok` of
`num_experts` SwiGLU experts per token (HF: softmax over all experts, top-k, then the k weights
renormalised when `norm_topk_prob`); no shared expert. On Megatron it is a `MoELayer` whose experts
are a `SequentialMLP` (one `MLP` per expert, `mlp.experts.local_experts.{e}.linear_fc1/2`) on the
local spec and Transformer Engine's grouped GEMM (`TEGroupedMLP`, `mlp.experts.linear_fc1/2.weight{e}`)
on the TE spec, each expert cut over expert TP like a dense MLP (GATE_UP, ROW). The table names experts
by their global index `e` (the EP1 layout) in the local spec's naming.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megarl.models.arch import GATE_UP, REPLICATED, ROW, LayerParam
from megarl.models.arch.dense import DenseDecoder, attention_flops_per_token, attention_parameters
from megarl.models.hf_config import ModelDims, read_number, read_positive_int


class Qwen3MoeDecoder(DenseDecoder):
    """Qwen3's dense decoder with every MLP a routed mixture of experts."""

    def read_dims(self, cfg: Mapping[str, Any]) -> ModelDims:
        step = cfg.get("decoder_sparse_step", 1)
        if step != 1:
            raise ValueError(
                f"config.json: decoder_sparse_step={step!r} is not supported: megarl builds Qwen3-MoE "
                "with experts in every layer (decoder_sparse_step 1)"
            )
        if cfg.get("mlp_only_layers"):
            raise ValueError(
                f"config.json: mlp_only_layers={cfg['mlp_only_layers']!r} is not supported: megarl "
                "builds Qwen3-MoE with experts in every layer (mlp_only_layers [])"
            )
        # Released checkpoints write `num_experts`; transformers 5 saves it as `num_local_experts`.
        num_experts = read_positive_int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts")
        top_k = read_positive_int(cfg, "num_experts_per_tok")
        if top_k > num_experts:
            raise ValueError(f"config.json: num_experts_per_tok={top_k} exceeds num_experts={num_experts}")
        return dataclasses.replace(
            self.read_shared_dims(cfg),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_ffn_hidden_size=read_positive_int(cfg, "moe_intermediate_size"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            router_aux_loss_coef=read_number(cfg, "router_aux_loss_coef", default=0.001),
        )

    def transformer_fields(self, dims: ModelDims) -> dict[str, Any]:
        return super().transformer_fields(dims) | dict(
            num_moe_experts=dims.num_experts,
            moe_router_topk=dims.num_experts_per_tok,
            moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
            moe_router_score_function="softmax",
            # Megatron's softmax over the top-k logits equals HF's softmax-then-top-k renormalised
            # (norm_topk_prob); pre-softmax is HF's softmax-then-top-k without renormalisation.
            moe_router_pre_softmax=not dims.norm_topk_prob,
            # HF computes the routing softmax in fp32 whatever the model's dtype.
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=dims.router_aux_loss_coef,
            moe_token_dispatcher_type="alltoall",
        )

    def layer_spec_options(self, dims: ModelDims, transformer_impl: str) -> dict[str, Any]:
        # Local: a SequentialMLP (one MLP per expert, plain torch). Transformer Engine: TEGroupedMLP, all
        # local experts in one grouped GEMM (`weight{e}` per expert: `layout` maps them to the table's names).
        return super().layer_spec_options(dims, transformer_impl) | {
            "num_experts": dims.num_experts,
            "moe_grouped_gemm": transformer_impl == "transformer_engine",
        }

    def layer_params(self, dims: ModelDims) -> tuple[LayerParam, ...]:
        experts = []
        for e in range(dims.num_experts):
            megatron, hf = f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}."
            experts += [
                LayerParam(megatron + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), GATE_UP),
                LayerParam(megatron + "linear_fc2.weight", (hf + "down_proj.weight",), ROW),
            ]
        return (
            *self.attention_params(dims),
            LayerParam("mlp.router.weight", ("mlp.gate.weight",), REPLICATED),
            *experts,
        )

    def hf_layer_shapes(self, dims: ModelDims) -> dict[str, tuple[int, ...]]:
        h, f = dims.hidden_size, dims.moe_ffn_hidden_size
        shapes = self.hf_attention_shapes(dims) | {"mlp.gate.weight": (dims.num_experts, h)}
        for e in range(dims.num_experts):
            shapes |= {
                f"mlp.experts.{e}.gate_proj.weight": (f, h),
                f"mlp.experts.{e}.up_proj.weight": (f, h),
                f"mlp.experts.{e}.down_proj.weight": (h, f),
            }
        return shapes

    def active_layer_parameters(self, dims: ModelDims) -> int:
        """Parameters one token passes through in one layer (attention, router and its top-k experts)."""
        experts = dims.num_experts_per_tok * 3 * dims.hidden_size * dims.moe_ffn_hidden_size
        return attention_parameters(dims, 1) + dims.num_experts * dims.hidden_size + experts

    def forward_flops_per_token(self, dims: ModelDims, sequence_length: int) -> int:
        """Active FLOPs: the router and the top-k experts a token passes through, not all experts."""
        h = dims.hidden_size
        moe = 2 * h * dims.num_experts + dims.num_experts_per_tok * 2 * 3 * h * dims.moe_ffn_hidden_size
        return dims.num_layers * (attention_flops_per_token(dims, sequence_length) + moe) + 2 * h * dims.vocab_size


def _tiny_fields(fields: dict) -> dict:
    """8 experts, top-2, renormalised, experts in every layer; an expert is half the dense MLP's size."""
    return {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": fields["intermediate_size"] // 2,
        **fields,
    }


ARCHITECTURE = Qwen3MoeDecoder(
    "qwen3_moe", qkv_bias=False, qk_layernorm=True, hf_config_class="Qwen3MoeConfig", tiny_fields=_tiny_fields
)
