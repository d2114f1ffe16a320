"""The weight-sync schedule: which trainer rank sends which block of which HF tensor to which vLLM
worker, from a plan (`megarl.bridge.plan`). Pure: no processes, no vLLM.

When the trainer ranks send their own shards (`shard_sync`), the schedule lists per bucket every piece
(a block of rows or columns of one HF tensor) that each trainer rank sends each vLLM worker, and how each
worker lays out its own tensors, so that senders and receivers replay the same list (as megatron-core's
`resharding/` planner does for its copy services):

    schedule = build_schedule(plan, vocab_divisible_by=128)
    schedule.sent_by(sender_rank(plan.layout, pp, tp))   # [(tag, Piece)], in send order
    schedule.buckets[b].received[worker]                 # worker's per-rank tensors of bucket b
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megarl.bridge.plan import LayoutPair, PlannedBucket, PlannedParam, SyncPlan
from megarl.bridge.protocol import BucketMetadata, TensorSlot
from megarl.models.arch import GATE_UP, QKV, REPLICATED, ROW, VOCAB
from megarl.models.hf_config import ModelDims
from megarl.models.layout import ROW_BLOCK_KINDS, padded_vocab_size

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
