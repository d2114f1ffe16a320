"""Megatron ⇄ HF weight layout: parameter names and the tensor-parallel slicing of each parameter kind.

Pure torch, no torch.distributed: the HF → Megatron checkpoint loader, the exporter and the weight-sync
bridge all go through these functions. The layout facts (ARCHITECTURE.md, "The weight-sync bridge"):

- `linear_qkv` rows hold whole KV groups, each group laid out [q heads of the group; k; v]; TP rank r
  owns groups [r*G/tp, (r+1)*G/tp), so concatenating the shards in rank order gives the global tensor.
- `linear_fc1` shard r is [gate rows of r; up rows of r].
- `linear_proj` / `linear_fc2` are row-parallel: split along columns (dim 1).
- word embeddings and `output_layer` are split along rows of the vocabulary padded to a multiple of
  `vocab_divisible_by * tp` (padding rows are zero when loaded, trimmed when exported).
- norms are replicated on every TP rank.

The per-layer table (which Megatron parameter is which HF tensors, of which kind, and the HF shapes)
is the model's architecture's (`megarl.models.arch`); the embedding, final norm and output layer
are every architecture's.

Megatron names are stage-local (`decoder.layers.{i}` counts from 0 on every PP stage); HF layer
indices add the stage's `layer_offset`.

    mapping = param_mapping("decoder.layers.0.self_attention.linear_qkv.weight", dims, layer_offset=2)
    shard = tp_shard_from_hf(mapping, reader_of(hf_tensors), dims, tp_size=2, tp_rank=1, vocab_divisible_by=128)
    megatron_to_hf(mapping.megatron_name, [shard0, shard1], dims, layer_offset=2)
    # -> [("model.layers.2.self_attn.q_proj.weight", q), ("...k_proj.weight", k), ("...v_proj.weight", v)]

Names carry no wrapper prefix: strip DDP's / Float16Module's `module.` before mapping.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from megarl.models.arch import GATE_UP, QKV, REPLICATED, ROW, VOCAB, LayerParam, architecture
from megarl.models.hf_config import ModelDims

VOCAB_DIVISIBLE_BY = 128
"""Megatron's `make_vocab_size_divisible_by` default: the vocabulary is padded to a multiple of this × TP
(the models megarl builds, the memory estimate and the weight sync all pad with it)."""

TensorReader = Callable[[str, tuple[slice, ...]], torch.Tensor]
"""`read(hf_name, index)` returns `hf_tensor[index]` (index: a tuple of slices); lets a loader read
only the rows/columns a rank needs (safetensors `get_slice`) with the same slicing code as in memory."""


@dataclass(frozen=True)
class ParamMapping:
    """How one Megatron parameter corresponds to HF tensors."""

    megatron_name: str
    """Stage-local Megatron name, e.g. `decoder.layers.0.mlp.linear_fc1.weight`."""
    hf_names: tuple[str, ...]
    """HF tensors it is made of, in order (q, k, v for QKV; gate, up for GATE_UP; else one)."""
    kind: str
    """One of REPLICATED, ROW, QKV, GATE_UP, VOCAB."""


_GLOBAL_PARAMS: dict[str, tuple[str, str]] = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", VOCAB),
    "decoder.final_layernorm.weight": ("model.norm.weight", REPLICATED),
    "output_layer.weight": ("lm_head.weight", VOCAB),
}
"""The GPTModel parameters outside the decoder layers, every architecture's: Megatron name → (HF name, kind)."""
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
"""Transformer-Engine-spec layer names → the local-spec names the architectures' tables use: TE fuses
each norm into the linear after it (`layer_norm_weight`)."""
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\..+)")
_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)")
"""Transformer Engine's grouped-GEMM experts (`TEGroupedMLP`): one `weight{e}` per local expert of a
fused linear, the local spec's `local_experts.{e}.linear_fc1/2.weight`."""


def is_expert(megatron_name: str) -> bool:
    """Whether a stage-local Megatron parameter belongs to one expert (split over EP ranks)."""
    match = _LAYER_NAME.fullmatch(megatron_name)
    return match is not None and _LOCAL_EXPERT.match(_local_spec_name(match.group(2))) is not None


def _local_spec_name(layer_suffix: str) -> str:
    """A layer parameter's name after `decoder.layers.{i}.` in the local spec's naming (the table's):
    Transformer Engine's fused norms and grouped experts renamed."""
    grouped = _GROUPED_EXPERT.fullmatch(layer_suffix)
    if grouped:
        return f"mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
    return _TE_FUSED_NORMS.get(layer_suffix, layer_suffix)


def expert_offset(dims: ModelDims, ep_size: int, ep_rank: int) -> int:
    """Global index of the first expert on EP rank `ep_rank` (experts split evenly, in order, as
    megatron's `MoELayer` assigns `local_expert_indices`)."""
    return ep_rank * (dims.num_experts // ep_size)


@functools.lru_cache(maxsize=64)
def _layer_table(dims: ModelDims) -> dict[str, LayerParam]:
    """The architecture's per-layer table (`megarl.models.arch`), by local-spec Megatron suffix."""
    return {param.megatron: param for param in architecture(dims.model_type).layer_params(dims)}


@functools.lru_cache(maxsize=64)
def _hf_layer_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """The architecture's HF tensors of one layer with their shapes (read only: shared by callers)."""
    return architecture(dims.model_type).hf_layer_shapes(dims)


def layer_offset(num_layers: int, pp_size: int, pp_rank: int, vpp_size: int = 1, vp_stage: int = 0) -> int:
    """Global index of the first layer of virtual stage `vp_stage` on pipeline stage `pp_rank` (layers split
    evenly). With `vpp_size` virtual stages the model is cut into pp_size × vpp_size chunks dealt round-robin:
    chunk `vp_stage` of rank `pp_rank` is chunk vp_stage × pp_size + pp_rank of the model, as megatron-core's
    `get_transformer_layer_offset` (megatron/core/transformer/transformer_layer.py) places it."""
    chunks = pp_size * vpp_size
    if num_layers % chunks:
        raise ValueError(
            f"num_hidden_layers={num_layers} is not divisible by pipeline parallel size {pp_size} "
            f"× virtual pipeline size {vpp_size}"
        )
    return (vp_stage * pp_size + pp_rank) * (num_layers // chunks)


def padded_vocab_size(vocab_size: int, vocab_divisible_by: int, tp_size: int) -> int:
    """Megatron's vocabulary rows: `vocab_size` rounded up to a multiple of divisible_by * tp."""
    multiple = vocab_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def param_mapping(
    megatron_name: str, dims: ModelDims, *, layer_offset: int = 0, expert_offset: int = 0
) -> ParamMapping:
    """The HF tensors behind a stage-local Megatron parameter name (no `module.` prefix).

    Expert names are EP-rank-local too (`mlp.experts.local_experts.{e}`): `expert_offset` (the EP
    rank × experts per EP rank, `expert_offset`) makes `e` the global expert the table names.

    With tied embeddings, the last stage's `output_layer.weight` (Megatron keeps a copy when PP > 1)
    maps to `model.embed_tokens.weight`. Raises ValueError for names with no HF counterpart.
    """
    if megatron_name in _GLOBAL_PARAMS:
        hf_name, kind = _GLOBAL_PARAMS[megatron_name]
        if megatron_name == "output_layer.weight" and dims.tie_word_embeddings:
            hf_name = "model.embed_tokens.weight"
        return ParamMapping(megatron_name, (hf_name,), kind)
    match = _LAYER_NAME.fullmatch(megatron_name)
    if match:
        suffix = _local_spec_name(match.group(2))
        expert = _LOCAL_EXPERT.match(suffix)
        if expert is not None:
            suffix = f"{expert.group(1)}{int(expert.group(2)) + expert_offset}{expert.group(3)}"
        param = _layer_table(dims).get(suffix)
        if param is not None:
            hf_layer = f"model.layers.{int(match.group(1)) + layer_offset}."
            return ParamMapping(megatron_name, tuple(hf_layer + s for s in param.hf), param.kind)
    raise ValueError(f"Megatron parameter {megatron_name!r} has no HF counterpart in megarl's layout table")


def megatron_name_of(hf_name: str, dims: ModelDims, *, pp_size: int) -> tuple[int, str]:
    """(pp_rank, stage-local Megatron name, local-spec naming) of the parameter holding an HF tensor.

    The inverse of `param_mapping`: q/k/v map to `linear_qkv`, gate/up to `linear_fc1`. A tied
    checkpoint's embedding is named by its first-stage owner.
    """
    for megatron_name, (global_hf_name, _) in _GLOBAL_PARAMS.items():
        if hf_name == global_hf_name:
            stage = 0 if megatron_name.startswith("embedding") else pp_size - 1
            return stage, megatron_name
    match = _HF_LAYER_NAME.fullmatch(hf_name)
    if match:
        per_stage = dims.num_layers // pp_size
        layer = int(match.group(1))
        for param in _layer_table(dims).values():
            if match.group(2) in param.hf:
                return layer // per_stage, f"decoder.layers.{layer % per_stage}.{param.megatron}"
    raise ValueError(f"HF tensor {hf_name!r} has no Megatron counterpart in megarl's layout table")


def hf_param_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of `dims` holds, with its shape (checks and exports)."""
    h = dims.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (dims.vocab_size, h), "model.norm.weight": (h,)}
    if not dims.tie_word_embeddings:
        shapes["lm_head.weight"] = (dims.vocab_size, h)
    for i in range(dims.num_layers):
        shapes |= {f"model.layers.{i}.{suffix}": shape for suffix, shape in _hf_layer_shapes(dims).items()}
    return shapes


def reader_of(tensors: Mapping[str, torch.Tensor]) -> TensorReader:
    """A `TensorReader` over in-memory HF tensors."""
    return lambda name, index: tensors[name][index]


def tp_shard_from_hf(
    mapping: ParamMapping,
    read: TensorReader,
    dims: ModelDims,
    *,
    tp_size: int,
    tp_rank: int,
    vocab_divisible_by: int,
) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of a Megatron parameter, reading only the HF slices it needs."""
    kind, names = mapping.kind, mapping.hf_names
    everything = (slice(None),)
    if kind == REPLICATED:
        return read(names[0], everything)
    if kind == ROW:
        cols = _chunk(_hf_layer_shape(names[0], dims)[1], tp_size, tp_rank)
        return read(names[0], (slice(None), cols))
    if kind == GATE_UP:
        rows = _chunk(_hf_layer_shape(names[0], dims)[0], tp_size, tp_rank)
        return torch.cat([read(names[0], (rows,)), read(names[1], (rows,))])
    if kind == QKV:
        return _qkv_shard(names, read, dims, tp_size, tp_rank)
    if kind == VOCAB:
        padded = padded_vocab_size(dims.vocab_size, vocab_divisible_by, tp_size)
        rows = _chunk(padded, tp_size, tp_rank)
        real = read(names[0], (slice(rows.start, min(rows.stop, dims.vocab_size)),))
        padding = real.new_zeros((rows.stop - rows.start - real.shape[0], *real.shape[1:]))
        return torch.cat([real, padding])
    raise ValueError(f"unknown parameter kind {kind!r} for {mapping.megatron_name}")


def merge_tp_shards(
    mapping: ParamMapping, shards: Sequence[torch.Tensor], dims: ModelDims
) -> list[tuple[str, torch.Tensor]]:
    """HF tensors of a Megatron parameter from all its TP shards (in TP rank order)."""
    outs = [shards[0].new_empty(shape) for shape in merged_shapes(mapping, shards, dims)]
    merge_tp_shards_into(mapping, shards, dims, outs)
    return list(zip(mapping.hf_names, outs))


def merged_shapes(mapping: ParamMapping, shards: Sequence[torch.Tensor], dims: ModelDims) -> list[tuple[int, ...]]:
    """The shapes of the HF tensors `merge_tp_shards` makes of these shards (in `hf_names` order)."""
    kind, first = mapping.kind, tuple(shards[0].shape)
    rows = sum(shard.shape[0] for shard in shards)
    if kind == REPLICATED:
        return [first]
    if kind == ROW:
        return [(first[0], sum(shard.shape[1] for shard in shards))]
    if kind == GATE_UP:
        return [(rows // 2, *first[1:])] * 2
    if kind == QKV:
        heads = rows // ((dims.heads_per_group + 2) * dims.head_dim)  # KV heads = groups
        q = (heads * dims.heads_per_group * dims.head_dim, *first[1:])
        return [q] + [(heads * dims.head_dim, *first[1:])] * 2
    if kind == VOCAB:
        return [(min(rows, dims.vocab_size), *first[1:])]
    raise ValueError(f"unknown parameter kind {kind!r} for {mapping.megatron_name}")


def merge_tp_shards_into(
    mapping: ParamMapping, shards: Sequence[torch.Tensor], dims: ModelDims, outs: Sequence[torch.Tensor]
) -> None:
    """`merge_tp_shards` written into `outs`, one tensor of `merged_shapes` per HF name (e.g. views of
    a bucket's flat buffer): each element is copied once, straight to its place."""
    expected = merged_shapes(mapping, shards, dims)
    if [tuple(out.shape) for out in outs] != expected:
        raise ValueError(
            f"{mapping.megatron_name}: {len(shards)} TP shards of shape {list(shards[0].shape)} merge into "
            f"{expected}, not into tensors of shapes {[list(out.shape) for out in outs]}"
        )
    kind = mapping.kind
    if kind == REPLICATED:
        outs[0].copy_(shards[0])
    elif kind == ROW:
        torch.cat(list(shards), dim=1, out=outs[0])
    elif kind in ROW_BLOCK_KINDS:
        for rank, shard in enumerate(shards):
            for out, (piece, rows) in zip(outs, shard_pieces(mapping, shard, dims, rank)):
                out[rows].view(piece.shape).copy_(piece)
    else:  # VOCAB: the shards in order, padding rows past the vocabulary dropped
        row = 0
        for shard in shards:
            take = min(shard.shape[0], dims.vocab_size - row)
            outs[0][row : row + take].copy_(shard[:take])
            row += take


ROW_BLOCK_KINDS = (GATE_UP, QKV)
"""Kinds whose TP shard fills one block of consecutive rows of each of its HF tensors (`shard_pieces`),
so that a shard can be received straight into place."""


def shard_pieces(
    mapping: ParamMapping, shard: torch.Tensor, dims: ModelDims, tp_rank: int
) -> list[tuple[torch.Tensor, slice]]:
    """TP rank `tp_rank`'s shard of a `ROW_BLOCK_KINDS` parameter as one `(piece, rows)` per HF tensor
    (`hf_names` order): the piece (a view of `shard`) fills `hf_tensor[rows]`, viewed as `piece.shape`.
    gate/up: the halves `[F_r, h]`; qkv: the q, k, v parts of the rank's n KV groups, `[n, hpg*d, ...]`
    and `[n, d, ...]` (strided views; `.contiguous()` before sending one)."""
    if mapping.kind == GATE_UP:
        rows = shard.shape[0] // 2
        block = slice(tp_rank * rows, (tp_rank + 1) * rows)
        return [(half, block) for half in shard.chunk(2)]
    if mapping.kind == QKV:
        d, hpg = dims.head_dim, dims.heads_per_group
        trailing = shard.shape[1:]
        n = shard.shape[0] // ((hpg + 2) * d)
        q, k, v = shard.reshape(n, (hpg + 2) * d, *trailing).split([hpg * d, d, d], dim=1)
        first = tp_rank * n
        kv_rows = slice(first * d, (first + n) * d)
        return [(q, slice(first * hpg * d, (first + n) * hpg * d)), (k, kv_rows), (v, kv_rows)]
    raise ValueError(f"{mapping.megatron_name}: a {mapping.kind} shard is not a block of rows of its HF tensors")


def megatron_to_hf(
    megatron_name: str, shards: Sequence[torch.Tensor], dims: ModelDims, *, layer_offset: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of a stage-local Megatron parameter from its TP shards (rank order)."""
    return merge_tp_shards(param_mapping(megatron_name, dims, layer_offset=layer_offset), shards, dims)


def tp_shards_from_hf(
    mapping: ParamMapping,
    hf_tensors: Mapping[str, torch.Tensor],
    dims: ModelDims,
    *,
    tp_size: int,
    vocab_divisible_by: int,
) -> list[torch.Tensor]:
    """All TP shards of a Megatron parameter from in-memory HF tensors (rank order)."""
    read = reader_of(hf_tensors)
    return [
        tp_shard_from_hf(mapping, read, dims, tp_size=tp_size, tp_rank=r, vocab_divisible_by=vocab_divisible_by)
        for r in range(tp_size)
    ]


def _chunk(size: int, tp_size: int, tp_rank: int) -> slice:
    if size % tp_size:
        raise ValueError(f"dimension {size} is not divisible by tensor parallel size {tp_size}")
    step = size // tp_size
    return slice(tp_rank * step, (tp_rank + 1) * step)


def _hf_layer_shape(hf_name: str, dims: ModelDims) -> tuple[int, ...]:
    """The shape of a decoder layer's HF tensor, from its architecture's table (e.g. o_proj's
    `[hidden, heads * head_dim]`, gate_proj's `[intermediate, hidden]`)."""
    match = _HF_LAYER_NAME.fullmatch(hf_name)
    if match is None:
        raise ValueError(f"{hf_name!r} is not an HF decoder-layer tensor name (model.layers.<i>.<name>)")
    return _hf_layer_shapes(dims)[match.group(2)]


def _qkv_shard(names, read: TensorReader, dims: ModelDims, tp_size: int, tp_rank: int) -> torch.Tensor:
    """[q heads of group g; k_g; v_g] for the KV groups of this rank: [groups_r * (hpg + 2) * d, ...]."""
    if dims.num_kv_heads % tp_size:
        raise ValueError(
            f"num_key_value_heads={dims.num_kv_heads} is not divisible by tensor parallel size {tp_size}: "
            "Megatron gives every TP rank whole KV groups"
        )
    d, hpg = dims.head_dim, dims.heads_per_group
    groups = _chunk(dims.num_kv_heads, tp_size, tp_rank)
    n = groups.stop - groups.start
    q = read(names[0], (slice(groups.start * hpg * d, groups.stop * hpg * d),))
    k = read(names[1], (slice(groups.start * d, groups.stop * d),))
    v = read(names[2], (slice(groups.start * d, groups.stop * d),))
    trailing = q.shape[1:]
    per_group = [q.reshape(n, hpg * d, *trailing), k.reshape(n, d, *trailing), v.reshape(n, d, *trailing)]
    return torch.cat(per_group, dim=1).reshape(n * (hpg + 2) * d, *trailing)
