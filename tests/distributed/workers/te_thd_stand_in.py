"""A CPU stand-in for megatron-core's `TEDotProductAttention` in the THD layout, and the Transformer
Engine layer spec with it (a plain module: the spawned ranks import it). Transformer Engine is
CUDA-only, so the spec function megarl calls for TE is replaced by the local spec with this core
attention; everything around it (megarl's spec edits, GPTModel, SelfAttention, RoPE per sequence)
is the real megatron-core 0.16.1 code.

What it mirrors:
- megatron/core/extensions/transformer_engine.py, `TEDotProductAttention.__init__` (the arguments
  `SelfAttention.__init__` builds core attention with) and `.forward`: for `qkv_format="thd"` the
  spec's `causal` becomes `padding_causal` (`no_mask` becomes `padding`), and the `PackedSeqParams`
  fields are handed to TE's `DotProductAttention` as keywords;
- transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py,
  `DotProductAttention.forward` (its docstring's cu_seqlens note): with "thd", q `[t, h, d]` and
  k/v `[t, h_kv, d]`, `cu_seqlens_q/kv` int32 `[n + 1]` offsets of the sequences, `max_seqlen_q/kv`
  their longest; `padding_causal` attends causally inside each sequence and never across; no
  `attention_mask`; softmax scale 1/sqrt(d); output `[t, h * d]`; query head `i` reads KV group
  `i // (h / h_kv)`.
Anything else (a dense layout, `arbitrary`, a mask, offsets that do not cover the row, a sequence
longer than `max_seqlen`) raises, so megarl sending TE something else fails the test.
"""

from __future__ import annotations

import math

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

THD_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)
"""The mask types TEDotProductAttention.forward sends TE as `padding_causal` for thd."""


class ThdDotProductAttention(MegatronModule):
    """TEDotProductAttention's THD contract in plain torch (fp32 softmax, one sequence at a time)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, num_splits=None, cp_comm_type="p2p",
                 pg_collection=None):
        super().__init__(config)
        if attention_type != "self":
            raise ValueError(f"stand-in: attention_type={attention_type!r}; a GPT decoder uses self-attention")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise AssertionError("stand-in: the Transformer Engine spec must get every micro-batch as THD")
        if attn_mask_type not in THD_CAUSAL:
            raise AssertionError(f"stand-in: attn_mask_type {attn_mask_type.name} is not causal inside THD sequences")
        if attention_mask is not None or attention_bias is not None:
            raise AssertionError("stand-in: TE's padding_causal THD attention takes no attention_mask or bias")
        offsets = self._offsets(packed_seq_params, query.shape[0])
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        outputs = []
        for start, end in zip(offsets, offsets[1:]):
            q, k, v = query[start:end].float(), key[start:end].float(), value[start:end].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.softmax_scale
            future = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).triu(diagonal=1)
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            outputs.append(torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype))
        return torch.cat(outputs).reshape(query.shape[0], -1)

    @staticmethod
    def _offsets(params, tokens: int) -> list[int]:
        cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
        if cu_q.dtype != torch.int32 or not torch.equal(cu_q, cu_kv):
            raise AssertionError("stand-in: self-attention THD offsets are int32 and equal for q and kv")
        offsets = cu_q.tolist()
        lengths = [end - start for start, end in zip(offsets, offsets[1:])]
        if offsets[0] != 0 or offsets[-1] != tokens or min(lengths) < 1:
            raise AssertionError(f"stand-in: cu_seqlens {offsets} must cover {tokens} tokens in non-empty sequences")
        if max(lengths) != params.max_seqlen_q or params.max_seqlen_q != params.max_seqlen_kv:
            raise AssertionError(f"stand-in: max_seqlen {params.max_seqlen_q} is not the longest, {max(lengths)}")
        return offsets


def stand_in_te_layer_spec(qk_layernorm: bool):
    """`get_gpt_layer_with_transformer_engine_spec(qk_layernorm=...)` as megarl calls it, with the
    local spec's modules and `ThdDotProductAttention` as core attention (its `attn_mask_type` entry
    is the TE spec's default, `causal`, which megarl's `layer_spec` sets again)."""
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = ThdDotProductAttention
    return spec


def use_stand_in_transformer_engine() -> None:
    """In this process, `transformer_impl="transformer_engine"` builds the stand-in spec."""
    from megarl.models import architectures

    architectures._te_importable = lambda: True
    architectures.get_gpt_layer_with_transformer_engine_spec = stand_in_te_layer_spec
