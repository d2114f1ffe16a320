"""The weight-sync plan: which Megatron parameter becomes which HF tensors, from which pipeline
stage, in which order, cut into which buckets. Pure: no processes, no vLLM.

The plan depends only on the model's dimensions, the (train TP, train PP) → rollout TP layout pair,
the dtype and the bucket size, so the sending trainer ranks and the receiving side (which must know
each bucket's metadata before the data arrives) compute the same plan independently. It is built
once per layout pair and cached (`build_plan` is memoised).

A *unit* is one Megatron parameter (all its TP shards): the gather/convert step turns it into one
or more HF tensors (q/k/v of `linear_qkv`, gate/up of `linear_fc1`). Units never straddle buckets,
so every fused vLLM layer (qkv_proj, gate_up_proj) receives all its parts within one bucket; a unit
larger than the bucket size travels alone in its own bucket. Buckets never straddle pipeline
stages (one stage sends each bucket) or dtypes (a bucket is one flat buffer).

    plan = build_plan(dims, LayoutPair(train_tp=2, train_pp=2, rollout_tp=2), bucket_mb=64)
    for bucket in plan.buckets:
        bucket.pp_rank, bucket.metadata.slots   # the stage that sends it; HF names, shapes, offsets
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from megarl.models.hf_config import ModelDims
from megarl.models.layout import REPLICATED, hf_param_shapes, param_mapping
from megarl.bridge.protocol import BucketMetadata, TensorSlot

MIB = 1 << 20


@dataclass(frozen=True)
class LayoutPair:
    """The trainer's Megatron layout and the rollout engine's TP, which the plan is built for."""

    train_tp: int
    """Megatron tensor-parallel size."""
    train_pp: int
    """Megatron pipeline-parallel size."""
    rollout_tp: int
    """vLLM tensor-parallel size of each rollout engine."""

    def __str__(self) -> str:
        return f"train TP={self.train_tp}/PP={self.train_pp} → rollout TP={self.rollout_tp}"


@dataclass(frozen=True)
class PlannedParam:
    """One Megatron parameter and the HF tensors it becomes."""

    megatron_name: str
    """Megatron name with the **global** layer index (as `MegatronActor.named_parameters_for_sync`
    yields it), local-spec naming (`input_layernorm`, `pre_mlp_layernorm`)."""
    pp_rank: int
    """The pipeline stage that holds it (and sends it)."""
    kind: str
    """Its TP layout (`megarl.models.layout`: replicated, row, qkv, gate_up, vocab)."""
    hf_names: tuple[str, ...]
    """The HF tensors it is merged into, in this order (q, k, v / gate, up / one)."""
    hf_shapes: tuple[tuple[int, ...], ...]
    """The full HF shape of each of `hf_names`."""

    @property
    def numel(self) -> int:
        """Elements of all its HF tensors (the vocab padding is trimmed before sending)."""
        return sum(math.prod(shape) for shape in self.hf_shapes)

    @property
    def needs_tp_gather(self) -> bool:
        """True when TP shards differ (everything but replicated norms)."""
        return self.kind != REPLICATED


@dataclass(frozen=True)
class PlannedBucket:
    """One bucket: sent by one pipeline stage, received as one flat buffer."""

    pp_rank: int
    """The stage whose TP rank 0 (of DP replica 0) assembles and sends it."""
    params: tuple[PlannedParam, ...]
    """Its units, in packing order."""
    metadata: BucketMetadata
    """The wire description: HF names, shapes, dtype and offsets in the flat buffer."""

    @property
    def nbytes(self) -> int:
        return self.metadata.numel * self.metadata.dtype.itemsize


@dataclass(frozen=True)
class SyncPlan:
    """Everything a sync does, in order; identical on every rank and on the receiving side."""

    layout: LayoutPair
    """The layout pair it was built for."""
    dims: ModelDims
    """The model's dimensions."""
    bucket_bytes: int
    """Bucket size limit; only a bucket holding a single unit may exceed it."""
    buckets: tuple[PlannedBucket, ...]
    """Buckets in send order."""

    @property
    def metadatas(self) -> list[BucketMetadata]:
        """How each bucket's HF tensors lie in its flat buffer, in send order."""
        return [bucket.metadata for bucket in self.buckets]

    @property
    def params(self) -> list[PlannedParam]:
        return [param for bucket in self.buckets for param in bucket.params]


def _megatron_param_names(dims: ModelDims) -> list[tuple[str, int]]:
    """`(global megatron name, layer index or -1)` of every parameter of megarl's local-spec GPTModel,
    in model order. With tied embeddings the LM head is the embedding (no `output_layer.weight`
    is sent; Megatron's last-stage copy is kept equal to it by the embedding all-reduce)."""
    names = [("embedding.word_embeddings.weight", -1)]
    for i in range(dims.num_layers):
        layer = f"decoder.layers.{i}."
        suffixes = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
        if dims.qkv_bias:
            suffixes.append("self_attention.linear_qkv.bias")
        if dims.qk_layernorm:
            suffixes += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
        suffixes += [
            "self_attention.linear_proj.weight",
            "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        ]
        names += [(layer + suffix, i) for suffix in suffixes]
    names.append(("decoder.final_layernorm.weight", dims.num_layers))
    if not dims.tie_word_embeddings:
        names.append(("output_layer.weight", dims.num_layers))
    return names


def _stage_of(layer: int, dims: ModelDims, pp_size: int) -> int:
    """Stage holding a layer index; -1 (embedding) → first stage, num_layers (head) → last."""
    if layer < 0:
        return 0
    if layer >= dims.num_layers:
        return pp_size - 1
    per_stage = dims.num_layers // pp_size
    return layer // per_stage


def _planned_params(dims: ModelDims, layout: LayoutPair) -> list[PlannedParam]:
    """Every unit of the model in send order (stage by stage, model order within a stage)."""
    hf_shapes = hf_param_shapes(dims)
    params = []
    for name, layer in _megatron_param_names(dims):
        mapping = param_mapping(name, dims)
        params.append(
            PlannedParam(
                megatron_name=name,
                pp_rank=_stage_of(layer, dims, layout.train_pp),
                kind=mapping.kind,
                hf_names=mapping.hf_names,
                hf_shapes=tuple(hf_shapes[n] for n in mapping.hf_names),
            )
        )
    params.sort(key=lambda p: p.pp_rank)  # stable: model order within a stage
    _check_covers_checkpoint(params, hf_shapes)
    return params


def _check_covers_checkpoint(params: list[PlannedParam], hf_shapes: dict[str, tuple[int, ...]]) -> None:
    sent = [name for p in params for name in p.hf_names]
    duplicated = sorted({n for n in sent if sent.count(n) > 1})
    missing = sorted(set(hf_shapes) - set(sent))
    if duplicated or missing:
        raise ValueError(f"weight-sync plan is inconsistent: HF tensors sent twice {duplicated}, never sent {missing}")


@functools.lru_cache(maxsize=16)
def build_plan(
    dims: ModelDims, layout: LayoutPair, *, bucket_mb: float = 64, dtype: torch.dtype = torch.float32
) -> SyncPlan:
    """The plan for `layout`, buckets of at most `bucket_mb` MiB of `dtype` (the dtype the weights
    travel in: the trainer's parameter dtype). Cached per argument tuple."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb}: the bucket size must be > 0 MiB (e.g. 64)")
    check_layout(dims, layout)
    bucket_bytes = int(bucket_mb * MIB)
    limit = bucket_bytes // dtype.itemsize
    groups: list[list[PlannedParam]] = []
    for param in _planned_params(dims, layout):
        current = groups[-1] if groups else None
        fits = current and current[0].pp_rank == param.pp_rank and sum(p.numel for p in current) + param.numel <= limit
        if fits:
            current.append(param)
        else:
            groups.append([param])
    buckets = tuple(PlannedBucket(g[0].pp_rank, tuple(g), _metadata(g, dtype)) for g in groups)
    return SyncPlan(layout=layout, dims=dims, bucket_bytes=bucket_bytes, buckets=buckets)


def check_layout(dims: ModelDims, layout: LayoutPair) -> None:
    """ValueError listing every way `layout` does not fit the model (before any process starts)."""
    problems = [
        f"{field}={getattr(layout, field)}: must be >= 1"
        for field in ("train_tp", "train_pp", "rollout_tp")
        if getattr(layout, field) < 1
    ]
    if not problems:
        if dims.num_kv_heads % layout.train_tp:
            problems.append(
                f"train TP={layout.train_tp} does not divide num_key_value_heads={dims.num_kv_heads} "
                "(Megatron gives every TP rank whole KV groups): pick a train TP that divides it"
            )
        if dims.num_layers % layout.train_pp:
            problems.append(
                f"train PP={layout.train_pp} does not divide num_hidden_layers={dims.num_layers}: pick one that does"
            )
        if dims.num_attention_heads % layout.rollout_tp:
            problems.append(
                f"rollout TP={layout.rollout_tp} does not divide num_attention_heads={dims.num_attention_heads} "
                "(vLLM splits query heads evenly): pick a rollout TP that divides it"
            )
    if problems:
        raise ValueError(f"weight-sync layout {layout} does not fit the model:\n  " + "\n  ".join(problems))


def _metadata(params: list[PlannedParam], dtype: torch.dtype) -> BucketMetadata:
    slots, offset = [], 0
    for param in params:
        for name, shape in zip(param.hf_names, param.hf_shapes):
            slots.append(TensorSlot(name, shape, dtype, offset))
            offset += math.prod(shape)
    return BucketMetadata(tuple(slots))
