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
expert-TP ranks of the EP rank that holds the expert (`expert_sender`), not over the TP ranks. Units never straddle buckets,
so every fused vLLM layer (qkv_proj, gate_up_proj) receives all its parts within one bucket; a unit
larger than the bucket size travels alone in its own bucket. Buckets never straddle pipeline
stages (one stage sends each bucket) or dtypes (a bucket is one flat buffer).

    plan = build_plan(dims, LayoutPair(train_tp=2, train_pp=2, rollout_tp=2), bucket_mb=64)
    for bucket in plan.buckets:
        bucket.pp_rank, bucket.metadata.slots   # the stage that sends it; HF names, shapes, offsets

The schedule (`build_schedule`, below) cuts the plan into what travels when the trainer ranks send
their own shards (`shard_sync`): per bucket, every piece (a block of rows or columns of one HF
tensor) that each trainer rank sends each vLLM worker, and how each worker lays out its own
tensors, so that senders and receivers replay the same list (as megatron-core's `resharding/`
planner does for its copy services):

    schedule = build_schedule(plan, vocab_divisible_by=128)
    schedule.sent_by(sender_rank(plan.layout, pp, tp))   # [(tag, Piece)], in send order
    schedule.buckets[b].received[worker]                 # worker's per-rank tensors of bucket b
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch

from megarl.bridge.protocol import BucketMetadata, TensorSlot
from megarl.models.arch import GATE_UP, QKV, REPLICATED, ROW, VOCAB, architecture
from megarl.models.hf_config import ModelDims
from megarl.models.layout import ROW_BLOCK_KINDS, hf_param_shapes, padded_vocab_size, param_mapping

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
    (`vllm_expert_range`) instead of a TP cut of every expert."""

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


# --- the schedule: who sends which piece of which HF tensor to whom ------------------------------
#
# Each trainer rank of DP replica 0 holds a block of every dense HF tensor of its stage (its Megatron
# TP shard), each rank of the first expert-DP replica a block of its EP rank's experts (its expert-TP
# shard), and each vLLM worker needs a block of it (its own TP shard, vLLM's per-rank layout).
# A piece is the intersection of the two along the tensor's split dimension; the schedule lists
# every piece once per receiving worker, so every element a worker needs arrives exactly once and a
# sender sends only what some worker needs. Blocks, in HF rows (columns for row-parallel layers):
#
# | kind      | Megatron TP rank t of T                 | vLLM TP rank r of R                          |
# |-----------|-----------------------------------------|----------------------------------------------|
# | qkv       | q, k, v rows of KV groups [tG/T, ..)    | q rows of heads [rH/R, ..); k, v of KV heads |
# |           |                                         | [rG/R, ..), or head r·G/R when R > G (vLLM   |
# |           |                                         | replicates KV heads: `QKVParallelLinear`)    |
# | gate_up   | gate, up rows [tF/T, ..)                | gate, up rows [rF/R, ..)                     |
# | row       | columns [tC/T, ..)                      | columns [rC/R, ..)                           |
# | vocab     | rows of the vocabulary padded to a      | rows of the vocabulary padded to a multiple  |
# |           | multiple of vocab_divisible_by · T      | of 64 (`VocabParallelEmbedding._get_indices`)|
# | replicated| the whole tensor                        | the whole tensor (sent by TP rank r mod T)   |
# | an expert | gate_up / row as above over its expert- | gate_up / row as above over R (fused-MoE     |
# | (EP)      | TP ranks t of E_T, on the EP rank that  | `w13_weight` / `w2_weight` rows of expert e);|
# |           | holds it, first expert-DP replica       | vLLM EP: whole, on the rank placing it       |
#
# Padding rows beyond the vocabulary are neither sent nor received (the receiver zeroes its own).

VLLM_VOCAB_PADDING = 64
"""vLLM pads the vocabulary to a multiple of this before splitting it (`DEFAULT_VOCAB_PADDING_SIZE`)."""


@dataclass(frozen=True)
class Piece:
    """One block of one HF tensor that one trainer rank sends to worker `worker` of every engine."""

    param: PlannedParam
    """The Megatron parameter whose HF tensor it is part of."""
    hf_index: int
    """Which of `param.hf_names`."""
    sender: int
    """The sending trainer rank's sync-group rank (`sender_rank`)."""
    tp_rank: int
    """The sender's train TP rank (whose shard holds the piece)."""
    worker: int
    """The receiving vLLM TP rank (of every engine)."""
    start: int
    """First HF row (columns: first column) of the piece."""
    stop: int
    """One past its last row / column."""
    source: int
    """Where it starts in the sender's block of the HF tensor (its shard's part), rows / columns."""
    target: int
    """Where it starts in the worker's per-rank tensor (`RankTensor`), rows / columns."""
    columns: bool
    """A block of columns (row-parallel layers), else of rows (or the whole tensor)."""
    shape: tuple[int, ...]
    """Its shape as sent."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketSchedule:
    """One bucket of the plan as it travels: its pieces, and what each worker assembles of it."""

    bucket: PlannedBucket
    """The plan's bucket (sent by one stage's TP ranks)."""
    pieces: tuple[Piece, ...]
    """Every piece of it, by worker, then parameter, HF tensor and sender: each sender sends its own
    in this order, each worker receives its own in this order."""
    received: tuple[BucketMetadata, ...]
    """Per worker: its per-rank tensors of the bucket in vLLM's names and shapes, laid out in one
    flat buffer (`protocol.unpack`)."""
    held: tuple[tuple[PlannedParam, ...], ...]
    """Per worker: the parameters of the bucket it holds, in the order of its `received` slots (all of
    them, but for the experts other workers hold under vLLM expert parallelism)."""


@dataclass(frozen=True)
class SyncSchedule:
    """The whole schedule of a plan, identical on every sender and receiver (`build_schedule`)."""

    plan: SyncPlan
    """The plan it cuts into pieces."""
    vocab_divisible_by: int
    """Megatron's `make_vocab_size_divisible_by` (where the trainer's vocabulary shards split)."""
    buckets: tuple[BucketSchedule, ...]
    """In plan order; bucket b travels with tag b."""

    def sent_by(self, sender: int) -> list[tuple[int, Piece]]:
        """`(tag, piece)` of every piece `sender` sends, in send order."""
        return [
            (tag, piece) for tag, bucket in enumerate(self.buckets) for piece in bucket.pieces if piece.sender == sender
        ]

    def bytes_sent(self, sender: int, engines: int) -> int:
        """What `sender` sends in one sync to `engines` engines."""
        itemsize = self.plan.dtype.itemsize
        return engines * itemsize * sum(piece.numel for _, piece in self.sent_by(sender))

    def bytes_needed(self, worker: int) -> int:
        """What worker `worker` of one engine needs: the real elements of its per-rank tensors
        (vocabulary padding rows excluded)."""
        itemsize = self.plan.dtype.itemsize
        return itemsize * sum(
            piece.numel for bucket in self.buckets for piece in bucket.pieces if piece.worker == worker
        )


def sender_rank(layout: LayoutPair, pp_rank: int, index: int) -> int:
    """Sync-group rank of the trainer rank `index` of stage `pp_rank` (its rank within the stage: the
    TP rank of DP replica 0 for dense shards, `expert_sender` for experts)."""
    return pp_rank * layout.stage_senders + index


def receiver_rank(layout: LayoutPair, engine_index: int, worker_rank: int) -> int:
    """Sync-group rank of rollout engine `engine_index`'s TP worker `worker_rank`."""
    return layout.senders + engine_index * layout.rollout_tp + worker_rank


def stage_index(layout: LayoutPair, *, tp_rank: int, dp_rank: int, etp_rank: int, ep_rank: int, expert_dp_rank: int):
    """This trainer rank's index within its stage (`sender_rank`'s `index`), or None when it sends
    nothing (neither DP replica 0 nor the first expert-DP replica). ValueError when its dense and
    expert coordinates do not name the same rank of the stage (the grid is not megatron's order)."""
    dense = tp_rank + layout.train_tp * dp_rank
    expert = etp_rank + layout.expert_tp * (ep_rank + layout.train_ep * expert_dp_rank)
    if dense != expert:
        raise ValueError(
            f"weight sync {layout}: this rank is rank {dense} of its stage by its TP/DP ranks ({tp_rank}, {dp_rank}) "
            f"but {expert} by its expert TP/EP/expert-DP ranks ({etp_rank}, {ep_rank}, {expert_dp_rank}); the sync "
            "expects megatron's rank order tp-cp-ep-dp-pp"
        )
    return dense if dense < layout.stage_senders else None


def expert_owner(dims: ModelDims, layout: LayoutPair, expert: int) -> int:
    """The train EP rank that holds global expert `expert` (`models.layout.expert_offset`)."""
    return expert // (dims.num_experts // layout.train_ep)


def expert_sender(dims: ModelDims, layout: LayoutPair, expert: int, etp_rank: int) -> int:
    """Stage index of expert-TP rank `etp_rank` of the EP rank holding `expert`, first expert-DP replica."""
    return etp_rank + layout.expert_tp * expert_owner(dims, layout, expert)


def vllm_expert_range(dims: ModelDims, tp_size: int, tp_rank: int) -> range:
    """The global experts vLLM rank `tp_rank` holds with expert parallelism (EP size = TP, one engine of
    data parallel 1): vLLM's linear placement (`expert_map_manager.determine_expert_map`): E // EP
    each, the first E % EP ranks one more."""
    base, extra = divmod(dims.num_experts, tp_size)
    start = tp_rank * base + min(tp_rank, extra)
    return range(start, start + base + (tp_rank < extra))


def holds(param: PlannedParam, layout: LayoutPair, dims: ModelDims, worker: int) -> bool:
    """Whether vLLM worker `worker` holds (a block of) `param`: every worker holds every parameter,
    but with vLLM expert parallelism an expert's only on the worker it is placed on."""
    return (
        param.expert < 0 or not layout.rollout_ep or param.expert in vllm_expert_range(dims, layout.rollout_tp, worker)
    )


def megatron_block(
    param: PlannedParam, hf_index: int, dims: ModelDims, tp_size: int, tp_rank: int, vocab_divisible_by: int
) -> range:
    """The HF rows (row-parallel: columns) of `param.hf_names[hf_index]` that train TP rank `tp_rank`
    (of an expert: expert-TP rank) holds, vocabulary padding cut (maybe empty)."""
    if param.kind == VOCAB:
        per_rank = padded_vocab_size(dims.vocab_size, vocab_divisible_by, tp_size) // tp_size
        return _clipped(tp_rank * per_rank, per_rank, dims.vocab_size)
    return _even_block(_split_size(param, hf_index), tp_size, tp_rank)


def vllm_block(
    param: PlannedParam, hf_index: int, dims: ModelDims, tp_size: int, tp_rank: int, *, expert_parallel: bool = False
) -> range:
    """The HF rows (row-parallel: columns) of `param.hf_names[hf_index]` that vLLM TP rank `tp_rank`
    holds, vocabulary padding cut. With `expert_parallel`, an expert is whole on the rank it is placed
    on (vLLM's expert TP is 1 then) and absent elsewhere."""
    if param.kind == VOCAB:
        per_rank = vllm_vocab_rows(dims, tp_size)
        return _clipped(tp_rank * per_rank, per_rank, dims.vocab_size)
    if param.kind == QKV and hf_index > 0 and tp_size > dims.num_kv_heads:
        head = tp_rank * dims.num_kv_heads // tp_size  # vLLM's `tp_rank // num_kv_head_replicas`
        return range(head * dims.head_dim, (head + 1) * dims.head_dim)
    if param.expert >= 0 and expert_parallel:
        held = param.expert in vllm_expert_range(dims, tp_size, tp_rank)
        return range(_split_size(param, hf_index) if held else 0)
    return _even_block(_split_size(param, hf_index), tp_size, tp_rank)


def vllm_vocab_rows(dims: ModelDims, tp_size: int) -> int:
    """Rows of a vLLM TP rank's vocabulary shard (padding included)."""
    return -(-dims.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // tp_size


def vllm_rank_name(param: PlannedParam) -> str:
    """vLLM's per-rank name of `param`: fused `qkv_proj` / `gate_up_proj`; an expert's
    `model.layers.{i}.mlp.experts.{e}.w13_weight` ([gate; up]) / `.w2_weight` (down), the rows of
    expert e (global) in the fused-MoE layer's `w13_weight [E_local, 2·I_r, h]` / `w2_weight
    [E_local, h, I_r]` (vLLM's `FusedMoE.weight_loader`: w1 rows first, then w3); else the HF name."""
    first = param.hf_names[0]
    if param.expert >= 0:
        leaf = "w13_weight" if param.kind == GATE_UP else "w2_weight"
        return first.rsplit(".", 2)[0] + "." + leaf
    if param.kind == QKV:
        return first.replace("q_proj", "qkv_proj")
    if param.kind == GATE_UP:
        return first.replace("gate_proj", "gate_up_proj")
    return first


def vllm_rank_tensor(
    param: PlannedParam, dims: ModelDims, tp_size: int, tp_rank: int, *, expert_parallel: bool = False
) -> tuple[str, tuple[int, ...]]:
    """vLLM TP rank `tp_rank`'s own tensor of `param` (`vllm_rank_name`) and its per-rank shape (qkv:
    `[q_r + k_r + v_r, ...]`, vocabulary: padding rows included; an expert with `expert_parallel`:
    whole, on the rank holding it)."""
    first = param.hf_shapes[0]
    name = vllm_rank_name(param)
    if param.kind == REPLICATED:
        return name, first
    if param.kind == ROW:
        return name, (first[0], len(vllm_block(param, 0, dims, tp_size, tp_rank, expert_parallel=expert_parallel)))
    if param.kind == VOCAB:
        return name, (vllm_vocab_rows(dims, tp_size), *first[1:])
    rows = sum(
        len(vllm_block(param, i, dims, tp_size, tp_rank, expert_parallel=expert_parallel))
        for i in range(len(param.hf_names))
    )
    return name, (rows, *first[1:])


def _split_size(param: PlannedParam, hf_index: int) -> int:
    shape = param.hf_shapes[hf_index]
    return shape[1] if param.kind == ROW else shape[0]


def _even_block(size: int, parts: int, index: int) -> range:
    return range(index * size // parts, (index + 1) * size // parts)


def _clipped(start: int, length: int, limit: int) -> range:
    return range(min(start, limit), min(start + length, limit))


def _part_offsets(param: PlannedParam, dims: ModelDims, layout: LayoutPair, worker: int) -> list[int]:
    """Where each HF tensor's block starts in vLLM worker `worker`'s per-rank tensor (rows)."""
    if param.kind not in ROW_BLOCK_KINDS:
        return [0]
    lengths = [
        len(vllm_block(param, i, dims, layout.rollout_tp, worker, expert_parallel=layout.rollout_ep))
        for i in range(len(param.hf_names))
    ]
    return [sum(lengths[:i]) for i in range(len(lengths))]


def _senders(param: PlannedParam, layout: LayoutPair, dims: ModelDims) -> list[tuple[int, int]]:
    """`(sync-group rank, train (expert-)TP rank)` of every rank holding a shard of `param`, in
    shard order: DP replica 0's TP ranks of its stage; an expert's, the expert-TP ranks of the EP rank
    holding it in the first expert-DP replica."""
    if param.expert < 0:
        return [(sender_rank(layout, param.pp_rank, t), t) for t in range(layout.train_tp)]
    return [
        (sender_rank(layout, param.pp_rank, expert_sender(dims, layout, param.expert, t)), t)
        for t in range(layout.expert_tp)
    ]


def _param_pieces(
    param: PlannedParam, layout: LayoutPair, dims: ModelDims, worker: int, vocab_divisible_by: int
) -> list[Piece]:
    """Every piece worker `worker` receives of `param`, in HF tensor then sender order."""
    if not holds(param, layout, dims, worker):
        return []
    pieces = []
    offsets = _part_offsets(param, dims, layout, worker)
    columns = param.kind == ROW
    senders = _senders(param, layout, dims)
    for index, shape in enumerate(param.hf_shapes):
        if param.kind == REPLICATED:
            sender, tp_rank = senders[worker % len(senders)]  # spread the replicated tensors over the stage's ranks
            pieces.append(Piece(param, index, sender, tp_rank, worker, 0, shape[0], 0, 0, False, shape))
            continue
        need = vllm_block(param, index, dims, layout.rollout_tp, worker, expert_parallel=layout.rollout_ep)
        for sender, tp_rank in senders:
            held = megatron_block(param, index, dims, len(senders), tp_rank, vocab_divisible_by)
            start, stop = max(need.start, held.start), min(need.stop, held.stop)
            if start >= stop:
                continue
            piece_shape = (shape[0], stop - start) if columns else (stop - start, *shape[1:])
            pieces.append(
                Piece(
                    param,
                    index,
                    sender,
                    tp_rank,
                    worker,
                    start,
                    stop,
                    start - held.start,
                    offsets[index] + start - need.start,
                    columns,
                    piece_shape,
                )
            )
    return pieces


@functools.lru_cache(maxsize=16)
def build_schedule(plan: SyncPlan, vocab_divisible_by: int) -> SyncSchedule:
    """The schedule of `plan` (cached per plan): every piece each trainer rank sends each vLLM
    worker, bucket by bucket. `vocab_divisible_by`: Megatron's `make_vocab_size_divisible_by`."""
    layout, dims, dtype = plan.layout, plan.dims, plan.dtype
    buckets = []
    for bucket in plan.buckets:
        pieces, received, held = [], [], []
        for worker in range(layout.rollout_tp):
            slots, offset = [], 0
            mine = tuple(param for param in bucket.params if holds(param, layout, dims, worker))
            for param in mine:
                pieces += _param_pieces(param, layout, dims, worker, vocab_divisible_by)
                name, shape = vllm_rank_tensor(
                    param, dims, layout.rollout_tp, worker, expert_parallel=layout.rollout_ep
                )
                slots.append(TensorSlot(name, shape, dtype, offset))
                offset += math.prod(shape)
            received.append(BucketMetadata(tuple(slots)))
            held.append(mine)
        buckets.append(BucketSchedule(bucket, tuple(pieces), tuple(received), tuple(held)))
    return SyncSchedule(plan, vocab_divisible_by, tuple(buckets))
