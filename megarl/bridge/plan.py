"""The weight-sync plan: which Megatron parameter becomes which HF tensors, from which pipeline
stage, in which order, cut into which buckets. Pure: no processes, no vLLM.

The plan depends only on the model's dimensions, the (train TP, PP, EP, expert TP) → rollout TP (and
vLLM expert parallelism) layout pair,
the dtype and the bucket size, so the sending trainer ranks and the receiving side (which must know
each bucket's metadata before the data arrives) compute the same plan independently. It is built
once per layout pair and cached (`build_plan` is memoised).

A *unit* is one Megatron parameter (all its TP shards): the gather/convert step turns it into one
or more HF tensors (q/k/v of `linear_qkv`, gate/up of `linear_fc1`). A mixture of experts has one
unit per expert parameter (`PlannedParam.expert`, the global expert): its shards are cut over the
expert-TP ranks of the EP rank that holds the expert (`schedule.expert_sender`), not over the TP ranks. Units never straddle buckets,
so every fused vLLM layer (qkv_proj, gate_up_proj) receives all its parts within one bucket; a unit
larger than the bucket size travels alone in its own bucket. Buckets never straddle pipeline
stages (one stage sends each bucket) or dtypes (a bucket is one flat buffer).

    plan = build_plan(dims, LayoutPair(train_tp=2, train_pp=2, rollout_tp=2), bucket_mb=64)
    for bucket in plan.buckets:
        bucket.pp_rank, bucket.metadata.slots   # the stage that sends it; HF names, shapes, offsets

The schedule of who sends which piece of which tensor to whom is `megarl.bridge.schedule`.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch

from megarl.bridge.protocol import BucketMetadata, TensorSlot
from megarl.models.arch import REPLICATED, architecture
from megarl.models.hf_config import ModelDims
from megarl.models.layout import hf_param_shapes, param_mapping

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
    train_vpp: int = 1
    """Megatron virtual pipeline stages per PP rank (1: none): which stage holds which layers."""
    train_ep: int = 1
    """Megatron expert-parallel size: EP rank r holds experts [r·E/EP, (r+1)·E/EP) of every layer."""
    train_etp: int | None = None
    """Megatron expert-tensor-parallel size (each expert's matrices cut over this many ranks); None: train TP."""
    rollout_ep: bool = False
    """vLLM expert parallelism (`enable_expert_parallel`): each rollout TP rank holds whole experts
    (`schedule.vllm_expert_range`) instead of a TP cut of every expert."""

    @property
    def expert_tp(self) -> int:
        """The trainer's expert-TP size (train TP unless set)."""
        return self.train_tp if self.train_etp is None else self.train_etp

    @property
    def stage_senders(self) -> int:
        """Sending ranks per pipeline stage: the first max(TP, ETP × EP) ranks of the stage, which hold
        DP replica 0's dense shards (ranks [0, TP)) and the first expert-DP replica's experts (ranks
        [0, ETP × EP)): megatron numbers a stage's ranks tp + TP·dp for the dense grid and
        etp + ETP·(ep + EP·expert_dp) for the experts' (its default order "tp-cp-ep-dp-pp")."""
        return max(self.train_tp, self.expert_tp * self.train_ep)

    @property
    def experts_split(self) -> bool:
        """Whether either side cuts the experts otherwise than the dense weights (train EP > 1, expert
        TP ≠ TP, vLLM expert parallelism): only the shard sync (`shard_sync`) handles such a layout."""
        return self.train_ep > 1 or self.expert_tp != self.train_tp or self.rollout_ep

    def refuse_split_experts(self, sync: str) -> None:
        """ValueError naming `sync` when the layout splits the experts (`experts_split`)."""
        if self.experts_split:
            raise ValueError(
                f"{sync} moves TP shards between TP ranks only, and {self} places the experts otherwise (expert "
                "parallelism or expert TP on the trainer, vLLM expert parallelism): use the collective transport "
                "(rollout.sync.transport: collective), whose shard sync sends each expert from the rank holding it "
                "to the worker holding it"
            )

    @property
    def senders(self) -> int:
        """Sending trainer ranks, all stages."""
        return self.stage_senders * self.train_pp

    def __str__(self) -> str:
        virtual = f"/VPP={self.train_vpp}" if self.train_vpp > 1 else ""
        experts = (
            f"/EP={self.train_ep}/ETP={self.expert_tp}" if (self.train_ep, self.expert_tp) != (1, self.train_tp) else ""
        )
        rollout_ep = " with vLLM EP" if self.rollout_ep else ""
        return (
            f"train TP={self.train_tp}/PP={self.train_pp}{virtual}{experts} → rollout TP={self.rollout_tp}{rollout_ep}"
        )


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
    expert: int = -1
    """The global expert an expert's parameter belongs to (-1: not an expert's)."""

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

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights travel in (the engines'): every sender casts to it before sending."""
        return self.buckets[0].metadata.dtype


def _megatron_param_names(dims: ModelDims) -> list[tuple[str, int]]:
    """`(global megatron name, layer index or -1)` of every parameter of megarl's local-spec GPTModel,
    in model order, a layer's from its architecture's table (`megarl.models.arch`). With tied
    embeddings the LM head is the embedding (no `output_layer.weight` is sent; Megatron's last-stage
    copy is kept equal to it by the embedding all-reduce)."""
    names = [("embedding.word_embeddings.weight", -1)]
    layer_params = architecture(dims.model_type).layer_params(dims)
    for i in range(dims.num_layers):
        names += [(f"decoder.layers.{i}.{param.megatron}", i) for param in layer_params]
    names.append(("decoder.final_layernorm.weight", dims.num_layers))
    if not dims.tie_word_embeddings:
        names.append(("output_layer.weight", dims.num_layers))
    return names


def _stage_of(layer: int, dims: ModelDims, pp_size: int, vpp_size: int) -> int:
    """Stage holding a layer index; -1 (embedding) → first stage, num_layers (head) → last. With virtual
    stages the layers come in pp_size × vpp_size chunks dealt round-robin over the stages
    (`megarl.models.layout.layer_offset`)."""
    if layer < 0:
        return 0
    if layer >= dims.num_layers:
        return pp_size - 1
    per_chunk = dims.num_layers // (pp_size * vpp_size)
    return layer // per_chunk % pp_size


_EXPERT = re.compile(r"decoder\.layers\.\d+\.mlp\.experts\.local_experts\.(\d+)\.")


def _planned_params(dims: ModelDims, layout: LayoutPair) -> list[PlannedParam]:
    """Every unit of the model in send order (stage by stage, model order within a stage)."""
    hf_shapes = hf_param_shapes(dims)
    params = []
    for name, layer in _megatron_param_names(dims):
        mapping = param_mapping(name, dims)
        expert = _EXPERT.match(name)
        params.append(
            PlannedParam(
                megatron_name=name,
                pp_rank=_stage_of(layer, dims, layout.train_pp, layout.train_vpp),
                kind=mapping.kind,
                hf_names=mapping.hf_names,
                hf_shapes=tuple(hf_shapes[n] for n in mapping.hf_names),
                expert=-1 if expert is None else int(expert.group(1)),
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
    if not (bucket_mb > 0 and math.isfinite(bucket_mb)):
        raise ValueError(f"bucket_mb={bucket_mb}: the bucket size must be a finite number > 0 MiB (e.g. 64)")
    check_layout(dims, layout)
    bucket_bytes = int(bucket_mb * MIB)
    limit = bucket_bytes // dtype.itemsize
    groups: list[list[PlannedParam]] = []
    for param in _planned_params(dims, layout):
        current = groups[-1] if groups else None
        if current and current[0].pp_rank == param.pp_rank and sum(p.numel for p in current) + param.numel <= limit:
            current.append(param)
        else:
            groups.append([param])
    buckets = tuple(PlannedBucket(g[0].pp_rank, tuple(g), _metadata(g, dtype)) for g in groups)
    return SyncPlan(layout=layout, dims=dims, bucket_bytes=bucket_bytes, buckets=buckets)


def check_layout(dims: ModelDims, layout: LayoutPair) -> None:
    """ValueError listing every way `layout` does not fit the model (before any process starts)."""
    problems = [
        f"{field}={getattr(layout, field)}: must be >= 1"
        for field in ("train_tp", "train_pp", "rollout_tp", "train_vpp", "train_ep", "expert_tp")
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
        elif layout.train_vpp > 1 and layout.train_pp == 1:
            problems.append(f"train VPP={layout.train_vpp} needs train PP > 1 (virtual stages interleave a pipeline)")
        elif dims.num_layers % (layout.train_pp * layout.train_vpp):
            problems.append(
                f"train PP={layout.train_pp} × VPP={layout.train_vpp} does not divide num_hidden_layers="
                f"{dims.num_layers}: pick sizes whose product does"
            )
        if dims.num_attention_heads % layout.rollout_tp:
            problems.append(
                f"rollout TP={layout.rollout_tp} does not divide num_attention_heads={dims.num_attention_heads} "
                "(vLLM splits query heads evenly): pick a rollout TP that divides it"
            )
        kv, tp = dims.num_kv_heads, layout.rollout_tp
        if kv % tp if tp <= kv else tp % kv:
            problems.append(
                f"rollout TP={tp} and num_key_value_heads={kv}: vLLM needs one to divide the other "
                "(it splits KV heads evenly or replicates them): pick a rollout TP that does"
            )
        if dims.ffn_hidden_size % tp:
            problems.append(
                f"rollout TP={tp} does not divide intermediate_size={dims.ffn_hidden_size}: pick one that does"
            )
        problems += _expert_problems(dims, layout)
    if problems:
        raise ValueError(f"weight-sync layout {layout} does not fit the model:\n  " + "\n  ".join(problems))


def _expert_problems(dims: ModelDims, layout: LayoutPair) -> list[str]:
    """How the layout's expert settings do not fit the model (a dense one takes none)."""
    experts, width = dims.num_experts, dims.moe_ffn_hidden_size
    if not experts:
        dense = (layout.train_ep, layout.expert_tp, layout.rollout_ep) != (1, layout.train_tp, False)
        return [f"{layout}: expert settings on a dense model (no experts): drop them"] if dense else []
    problems = []
    if experts % layout.train_ep:
        problems.append(f"train EP={layout.train_ep} does not divide num_experts={experts}: pick one that does")
    if width % layout.expert_tp:
        problems.append(
            f"train expert TP={layout.expert_tp} does not divide moe_intermediate_size={width}: pick one that does"
        )
    if layout.rollout_ep and experts < layout.rollout_tp:
        problems.append(
            f"rollout TP={layout.rollout_tp} with vLLM expert parallelism: more ranks than num_experts={experts} "
            "(vLLM gives every rank at least one expert): pick a rollout TP of at most that"
        )
    if not layout.rollout_ep and width % layout.rollout_tp:
        problems.append(
            f"rollout TP={layout.rollout_tp} does not divide moe_intermediate_size={width} (vLLM cuts every "
            "expert over its TP ranks): pick one that does, or use vLLM expert parallelism"
        )
    return problems


def _metadata(params: list[PlannedParam], dtype: torch.dtype) -> BucketMetadata:
    slots, offset = [], 0
    for param in params:
        for name, shape in zip(param.hf_names, param.hf_shapes):
            slots.append(TensorSlot(name, shape, dtype, offset))
            offset += math.prod(shape)
    return BucketMetadata(tuple(slots))
