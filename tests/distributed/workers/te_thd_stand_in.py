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

Context parallelism (`config.context_parallel_size` > 1), what `TEDotProductAttention.__init__` hands TE
then (`cp_group=pg_collection.cp`, `cp_global_ranks`, `cp_comm_type`) and what TE's THD CP attention,
`AttnFuncWithCPAndKVP2P` (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py;
the one CP scheme TE runs for thd: its tests/pytorch/attention/test_attention_with_cp.py skips thd for
"all_gather" and "a2a"), takes: q/k/v hold this rank's `t / CP` tokens, `cu_seqlens_q/kv` and
`max_seqlen` are the whole row's (every sequence a multiple of 2·CP long), and the rank's tokens of a
sequence are its chunks `cp_rank` and `2·CP - 1 - cp_rank` of 2·CP (TE's `thd_get_partitioned_indices`;
the dual-chunk order the fused RoPE kernel below also reads). The output is exact causal attention of
those queries over the whole sequence, `[t / CP, h * d]`. TE's ring passes K/V chunks between neighbours
and merges partial softmaxes; the stand-in all-gathers K/V (megatron's `gather_from_sequence_parallel_
region`, whose backward reduce-scatters the K/V gradients to their owners, as the ring's backward sends
them home) and computes the same attention at once: the ring's overlap is a GPU performance matter.

And a stand-in for TE's fused THD RoPE, `fused_rope_thd`, which megatron-core's RoPE calls in place
of its unfused per-sequence loop when `config.apply_rope_fusion` is set (megarl sets it on the TE
spec: `megarl.models.architectures.rope_fusion`). What it mirrors:
- megatron/core/models/common/embeddings/rope_utils.py, `apply_rotary_pos_emb`: with the flag and
  `cu_seqlens`, it returns `fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_size=...,
  cp_rank=...)` (a module attribute, imported from megatron/core/extensions/transformer_engine.py,
  None without TE: `TransformerConfig.__post_init__` refuses the flag then);
- that wrapper hands it to transformer_engine/pytorch/attention/rope.py, `apply_rotary_pos_emb(t,
  freqs, tensor_format="thd", fused=True, cu_seqlens=..., cp_size=..., cp_rank=...)` (no
  `interleaved`: halves are rotated), whose docstring gives the contract: t `[t, h, d]`, freqs
  `[s2, 1, 1, d2]` float32 with `d2 <= d` (the first `d2` channels rotate, the rest pass),
  `cu_seqlens` int32 `[b + 1]`;
- the kernel, transformer_engine/common/fused_rope/fused_rope.cu (`fused_rope_forward_kernel`,
  `fused_rope_block_forward`): token `start + i` of a THD sequence takes row `i` of `freqs`
  (positions restart at each sequence); with `cp_size` > 1, `cu_seqlens` are the whole row's, a
  sequence's local tokens start at `cu_seqlens[b] / cp_size`, and local token `s` of `L / cp_size` takes
  row `s + cp_rank·half` in its first half, `L - (cp_rank + 1)·half + (s - half)` in its second
  (`half = L / (2·cp_size)`: chunks `cp_rank` and `2·cp_size - 1 - cp_rank`); `x * cos + rotate_half(x)
  * sin` in float32 (`sincosf` of the float32 angle), stored in `t`'s dtype; channels past `d2` copied.
"""

from __future__ import annotations

import math

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

THD_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)
"""The mask types TEDotProductAttention.forward sends TE as `padding_causal` for thd."""

ROPE_CALLS: list[list[int]] = []
"""The `cu_seqlens` of every `fused_rope_thd` call in this process, in order (the test reads which
micro-batches took the fused path)."""


class ThdDotProductAttention(MegatronModule):
    """TEDotProductAttention's THD contract in plain torch (fp32 softmax, one sequence at a time)."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        num_splits=None,
        cp_comm_type="p2p",
        pg_collection=None,
    ):
        super().__init__(config)
        if attention_type != "self":
            raise ValueError(f"stand-in: attention_type={attention_type!r}; a GPT decoder uses self-attention")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.cp_group = None
        if config.context_parallel_size > 1:
            # TEDotProductAttention.__init__: cp_group from the collection, cp_comm_type from the config.
            if cp_comm_type != "p2p":
                raise AssertionError(f"stand-in: TE runs THD context parallelism with p2p only, got {cp_comm_type!r}")
            if pg_collection.cp.size() != config.context_parallel_size:
                raise AssertionError("stand-in: pg_collection.cp is not the config's context-parallel group")
            self.cp_group = pg_collection.cp

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type,
        attention_bias=None,
        packed_seq_params=None,
        num_splits=None,
    ):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise AssertionError("stand-in: the Transformer Engine spec must get every micro-batch as THD")
        if attn_mask_type not in THD_CAUSAL:
            raise AssertionError(f"stand-in: attn_mask_type {attn_mask_type.name} is not causal inside THD sequences")
        if attention_mask is not None or attention_bias is not None:
            raise AssertionError("stand-in: TE's padding_causal THD attention takes no attention_mask or bias")
        cp_size = 1 if self.cp_group is None else self.cp_group.size()
        offsets = self._offsets(packed_seq_params, query.shape[0] * cp_size)
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        if cp_size > 1:
            return self._context_parallel(query, key, value, offsets, cp_size)
        outputs = []
        for start, end in zip(offsets, offsets[1:]):
            q, k, v = query[start:end].float(), key[start:end].float(), value[start:end].float()
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.softmax_scale
            future = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).triu(diagonal=1)
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            outputs.append(torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype))
        return torch.cat(outputs).reshape(query.shape[0], -1)

    def _context_parallel(self, query, key, value, offsets, cp_size):
        """Queries of this rank's two chunks per sequence against the sequence's keys from every rank."""
        rank, every_key, every_value = (
            self.cp_group.rank(),
            *(
                gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=self.cp_group)
                for t in (key, value)
            ),
        )
        local_tokens = query.shape[0]
        outputs = []
        for start, end in zip(offsets, offsets[1:]):
            length = end - start
            if length % (2 * cp_size):
                raise AssertionError(f"stand-in: a THD sequence of {length} tokens under CP {cp_size} (TE wants 2·CP)")
            half, local_start = length // (2 * cp_size), start // cp_size
            # Chunk j of 2·CP sits on rank j (first half of its share) or 2·CP - 1 - j (second half).
            chunks = []
            for j in range(2 * cp_size):
                owner, second = (j, 0) if j < cp_size else (2 * cp_size - 1 - j, 1)
                at = owner * local_tokens + local_start + second * half
                chunks.append((every_key[at : at + half], every_value[at : at + half]))
            k = torch.cat([c[0] for c in chunks]).float()
            v = torch.cat([c[1] for c in chunks]).float()
            q = query[local_start : local_start + 2 * half].float()
            q_positions = torch.cat(
                [torch.arange(i * half, (i + 1) * half) for i in (rank, 2 * cp_size - 1 - rank)]
            ).to(q.device)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.softmax_scale
            future = torch.arange(length, device=q.device)[None, :] > q_positions[:, None]
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            outputs.append(torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype))
        return torch.cat(outputs).reshape(local_tokens, -1)

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


def fused_rope_thd(t, cu_seqlens, freqs, cp_size=1, cp_rank=0):
    """TE's fused THD RoPE, `fused_apply_rotary_pos_emb_thd`, in plain torch (module docstring)."""
    if t.dim() != 3:
        raise AssertionError(f"stand-in: fused THD RoPE takes t as [t, h, d], got {tuple(t.shape)}")
    if freqs.dim() != 4 or freqs.shape[1:3] != (1, 1) or freqs.dtype != torch.float32 or freqs.shape[3] > t.shape[2]:
        raise AssertionError(
            f"stand-in: freqs must be float32 [s, 1, 1, d2 <= {t.shape[2]}], got {freqs.dtype} {tuple(freqs.shape)}"
        )
    offsets = _rope_offsets(cu_seqlens, t.shape[0] * cp_size, freqs.shape[0])
    ROPE_CALLS.append(offsets)
    positions = torch.cat([_rope_positions(end - start, cp_size, cp_rank) for start, end in zip(offsets, offsets[1:])])
    angles = freqs[positions.to(freqs.device), 0]  # [t, 1, d2]
    rotated, passed = t[..., : angles.shape[-1]].float(), t[..., angles.shape[-1] :]
    first, second = rotated.chunk(2, dim=-1)
    out = rotated * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()
    return torch.cat([out.to(t.dtype), passed], dim=-1)


def _rope_positions(length: int, cp_size: int, cp_rank: int):
    """The `freqs` rows of a sequence's `length / cp_size` local tokens (the kernel's `s_id_for_freqs`)."""
    local = torch.arange(length // cp_size)
    if cp_size == 1:
        return local
    if length % (2 * cp_size):
        raise AssertionError(f"stand-in: fused RoPE under CP {cp_size} needs sequences of a multiple of 2·CP")
    half = length // (2 * cp_size)
    return torch.where(local < half, local + cp_rank * half, length - (cp_rank + 1) * half + local - half)


def _rope_offsets(cu_seqlens, tokens: int, table_rows: int) -> list[int]:
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise AssertionError(
            f"stand-in: cu_seqlens must be int32 [b + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    offsets = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or offsets[-1] != tokens or min(lengths) < 0:
        raise AssertionError(f"stand-in: cu_seqlens {offsets} must cover the {tokens} tokens of t")
    if max(lengths) > table_rows:
        raise AssertionError(f"stand-in: a sequence of {max(lengths)} tokens, freqs has {table_rows} positions")
    return offsets


def stand_in_te_layer_spec(qk_layernorm: bool):
    """`get_gpt_layer_with_transformer_engine_spec(qk_layernorm=...)` as megarl calls it, with the
    local spec's modules and `ThdDotProductAttention` as core attention (its `attn_mask_type` entry
    is the TE spec's default, `causal`, which megarl's `layer_spec` sets again)."""
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = ThdDotProductAttention
    return spec


def use_stand_in_transformer_engine() -> None:
    """In this process, `transformer_impl="transformer_engine"` builds the stand-in spec, and
    megatron's RoPE finds the fused THD kernel (only that one: the TE spec never gets `sbhd`
    micro-batches, so megatron's fused `sbhd` RoPE stays None and would fail the test)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.models import architectures

    architectures._te_importable = lambda: True
    architectures.get_gpt_layer_with_transformer_engine_spec = stand_in_te_layer_spec
    rope_utils.fused_apply_rotary_pos_emb_thd = fused_rope_thd
