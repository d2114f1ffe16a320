"""The shard sync's schedule without processes (`plan.build_schedule`, `shard_sync`), for every
layout pair train (TP, PP) ∈ {1, 2, 4} × {1, 2} → rollout TP ∈ {1, 2, 4}:

- coverage: every element of every vLLM worker's per-rank tensors is the target of exactly one
  piece (the vocabulary padding rows of none), and every piece lies in its sender's shard, so a
  sender sends only what some worker needs, and the bytes sent add up to the bytes needed;
- data: the senders' pieces cut from Megatron shards (`shard_sync`'s own sender functions) and
  assembled by the receiver's `receive_bucket` give each worker the tensors vLLM's weight loaders
  would make of the checkpoint. The oracle (`_vllm_rank_tensor`) slices the HF tensors directly by
  the rules of the installed vLLM: `QKVParallelLinear.weight_loader` (q heads split evenly, KV heads
  split or replicated, `shard_rank = tp_rank // num_kv_head_replicas`),
  `MergedColumnParallelLinear.weight_loader` (gate and up halves split evenly),
  `RowParallelLinear.weight_loader` (input columns split evenly) and
  `VocabParallelEmbedding._get_indices` (vocabulary padded to 64, split evenly, padding zero),
  all in vllm/model_executor/layers/. The exact sync check (`checksum.VllmRankLayout`) adds the
  workers' tensors up to the checkpoint's checksums, replicated KV heads included."""

from __future__ import annotations

import itertools

import pytest
import torch
from bridge_emulate import VOCAB_DIVISIBLE_BY, dims_of, megatron_shards, random_hf_tensors, stage_ranks

from megarl.bridge.checksum import LoadedChecksums, VllmRankLayout, check_checksums, recorded, tensor_checksum
from megarl.bridge.convert import to_vllm_rank
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.protocol import unpack
from megarl.bridge.schedule import build_schedule, megatron_block, receiver_rank, sender_rank
from megarl.bridge.shard_sync import piece_tensor, rank_tensors_as_hf, receive_bucket, shard_block

PAIRS = [(tp, pp, rollout) for tp, pp, rollout in itertools.product((1, 2, 4), (1, 2), (1, 2, 4))]


class _Wire:
    """`receive_bucket`'s receive: each sender's tensors in send order, copied into the destination."""

    def __init__(self, sent):
        self.sent = sent

    def __call__(self, destination: torch.Tensor, sender: int):
        destination.copy_(next(self.sent[sender]))
        return self

    def wait(self) -> None:
        pass


def _sent(schedule, bucket, worker, shards):
    """Each sender's tensors for `worker` of one bucket, in its send order, cut from its own shard."""
    sent = {}
    for piece in bucket.pieces:
        if piece.worker == worker:
            shard = shards[piece.param.megatron_name][piece.tp_rank].contiguous()
            block = shard_block(piece, shard, schedule.plan.dims)
            sent.setdefault(piece.sender, []).append(piece_tensor(schedule, piece, block))
    return {sender: iter(tensors) for sender, tensors in sent.items()}


def _vllm_rank_tensor(param, hf, dims, tp: int, rank: int) -> torch.Tensor:
    """vLLM TP rank `rank`'s tensor of `param`, sliced from the HF tensors by vLLM's rules (docstring)."""
    d, tensors = dims.head_dim, [hf[name] for name in param.hf_names]
    if param.kind == "replicated":
        return tensors[0]
    if param.kind == "row":
        return tensors[0].chunk(tp, dim=1)[rank]
    if param.kind == "gate_up":
        return torch.cat([t.chunk(tp)[rank] for t in tensors])
    if param.kind == "qkv":
        q, k, v = tensors
        kv_head = rank * dims.num_kv_heads // tp if tp > dims.num_kv_heads else None
        kv = [t[kv_head * d : (kv_head + 1) * d] if kv_head is not None else t.chunk(tp)[rank] for t in (k, v)]
        return torch.cat([q.chunk(tp)[rank], *kv])
    padded = -(-dims.vocab_size // 64) * 64
    out = tensors[0].new_zeros(padded, *tensors[0].shape[1:])
    out[: dims.vocab_size] = tensors[0]
    return out.chunk(tp)[rank]


def _dims(tp: int, rollout: int):
    # KV heads 4 fit every TP here; 2 KV heads make rollout TP 4 replicate them (vLLM's KV replicas).
    return (
        dims_of("qwen2", vocab_size=300)
        if tp == 4 or rollout < 4
        else dims_of("qwen2", num_key_value_heads=2, vocab_size=300)
    )


@pytest.mark.parametrize("tp,pp,rollout", PAIRS)
def test_every_element_a_worker_needs_arrives_once_from_a_sender_that_holds_it(tp, pp, rollout):
    dims = _dims(tp, rollout)
    layout = LayoutPair(tp, pp, rollout)
    schedule = build_schedule(build_plan(dims, layout, bucket_mb=0.25), VOCAB_DIVISIBLE_BY)
    for bucket in schedule.buckets:
        for piece in bucket.pieces:
            assert piece.sender == sender_rank(layout, bucket.bucket.pp_rank, piece.tp_rank)  # its own stage
            if piece.param.kind != "replicated":
                held = megatron_block(piece.param, piece.hf_index, dims, tp, piece.tp_rank, VOCAB_DIVISIBLE_BY)
                assert held.start <= piece.start < piece.stop <= held.stop
                assert piece.source == piece.start - held.start
        for worker in range(rollout):
            for param, (_, slot_view) in zip(
                bucket.bucket.params,
                unpack(
                    torch.zeros(bucket.received[worker].numel),  # counts
                    bucket.received[worker],
                ),
            ):
                for piece in (p for p in bucket.pieces if p.worker == worker and p.param is param):
                    width = piece.stop - piece.start
                    region = (
                        slot_view[:, piece.target : piece.target + width]
                        if piece.columns
                        else slot_view[piece.target : piece.target + width]
                    )
                    region += 1
                real = slot_view
                if param.kind == "vocab":
                    rows = [
                        p.target + p.stop - p.start for p in bucket.pieces if p.worker == worker and p.param is param
                    ]
                    real, padding = slot_view[: max(rows, default=0)], slot_view[max(rows, default=0) :]
                    assert padding.eq(0).all(), param.megatron_name
                assert real.eq(1).all(), (param.megatron_name, worker)
    sent = sum(
        schedule.bytes_sent(sender_rank(layout, pp_rank, tp_rank), engines=1)
        for pp_rank in range(pp)
        for tp_rank in range(tp)
    )
    assert sent == sum(schedule.bytes_needed(worker) for worker in range(rollout))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tp,pp,rollout", [(2, 1, 1), (1, 1, 2), (4, 1, 2), (2, 2, 4), (1, 2, 1), (2, 1, 4)])
def test_workers_assemble_the_tensors_vllm_would_load(arch, tp, pp, rollout):
    # qwen2 at rollout TP 4 with 2 KV heads: vLLM replicates each KV head on two workers.
    kv = {"num_key_value_heads": 2} if (arch, tp, rollout) == ("qwen2", 2, 4) else {}
    dims = dims_of(arch, vocab_size=300, **kv)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(tp, pp, rollout), bucket_mb=0.25)
    schedule = build_schedule(plan, VOCAB_DIVISIBLE_BY)
    shards = megatron_shards(plan, hf)
    records = []
    for worker in range(rollout):
        records.append(LoadedChecksums("float32"))
        for bucket in schedule.buckets:
            flat = receive_bucket(bucket, worker, _Wire(_sent(schedule, bucket, worker, shards)), torch.device("cpu"))
            received = recorded(
                unpack(flat, bucket.received[worker]), records[-1], VllmRankLayout(dims, rollout, worker)
            )
            for param, (name, tensor) in zip(bucket.bucket.params, received):
                assert torch.equal(tensor, _vllm_rank_tensor(param, hf, dims, rollout, worker)), (name, worker)
                if tp == rollout and param.kind != "vocab":  # the per-rank sync's conversion agrees
                    vllm_name, per_rank = to_vllm_rank(param, shards[param.megatron_name][worker], dims, tp)
                    assert name == vllm_name and torch.equal(tensor, per_rank)
    expected = {name: tensor_checksum(tensor, torch.float32) for name, tensor in hf.items()}
    check_checksums(expected, records, dtype="float32", layout=plan.layout, engine="e")


def test_a_tp1_worker_gets_the_checkpoint_back():
    dims = dims_of("qwen2", vocab_size=300)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(2, 2, 1), bucket_mb=0.25)
    schedule = build_schedule(plan, VOCAB_DIVISIBLE_BY)
    shards = megatron_shards(plan, hf)
    received = []
    for bucket in schedule.buckets:
        flat = receive_bucket(bucket, 0, _Wire(_sent(schedule, bucket, 0, shards)), torch.device("cpu"))
        received += unpack(flat, bucket.received[0])
    loaded = dict(rank_tensors_as_hf(plan, received))
    assert loaded.keys() == hf.keys()
    assert all(torch.equal(loaded[name], hf[name]) for name in hf)


def test_replicated_tensors_are_spread_over_the_stage_and_vocabulary_padding_is_not_sent():
    dims = dims_of("qwen2", vocab_size=300)  # padded to 512 at train TP 4 (128 rows per rank), 320 in vLLM
    layout = LayoutPair(4, 1, 2)
    schedule = build_schedule(build_plan(dims, layout, bucket_mb=0.25), VOCAB_DIVISIBLE_BY)
    pieces = [p for b in schedule.buckets for p in b.pieces]
    norms = {p.worker: p.tp_rank for p in pieces if p.param.megatron_name == "decoder.final_layernorm.weight"}
    assert norms == {0: 0, 1: 1}
    embedding = sorted(
        (p.worker, p.tp_rank, p.start, p.stop)
        for p in pieces
        if p.param.kind == "vocab" and p.param.megatron_name.startswith("embedding")
    )
    # vLLM rank 0: rows 0..159, rank 1: rows 160..299 (its rows 300..319 are padding); TP rank 3: none.
    assert embedding == [(0, 0, 0, 128), (0, 1, 128, 160), (1, 1, 160, 256), (1, 2, 256, 300)]


def test_a_model_padded_otherwise_is_refused():
    dims = dims_of("qwen2")
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(2, 1, 1), bucket_mb=0.25)
    shards = megatron_shards(plan, hf)  # padded with VOCAB_DIVISIBLE_BY (128 per rank at TP 2)
    schedule = build_schedule(plan, 64)  # the schedule believes 64 rows per rank
    piece = next(p for b in schedule.buckets for p in b.pieces if p.param.kind == "vocab" and p.tp_rank == 1)
    block = shard_block(piece, shards[piece.param.megatron_name][1], dims)
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by"):
        piece_tensor(schedule, piece, block[: piece.source + 1])


def test_group_ranks_put_senders_first():
    layout = LayoutPair(train_tp=2, train_pp=2, rollout_tp=2)
    assert [sender_rank(layout, pp, tp) for pp in range(2) for tp in range(2)] == [0, 1, 2, 3]
    assert [receiver_rank(layout, k, r) for k in range(2) for r in range(2)] == [4, 5, 6, 7]


# --- experts ----------------------------------------------------------------------------------------
#
# A mixture of experts on the trainer: each expert's shards lie on the expert-TP ranks of the EP rank
# holding it, in the first expert-DP replica (megatron's grid, `bridge_emulate.stage_ranks`); in vLLM
# every worker holds a TP cut of every expert (`FusedMoE.weight_loader`: w13 rows [gate_r; up_r], w2
# columns of rank r), or with expert parallelism whole experts, placed linearly
# (`expert_map_manager.determine_expert_map`: E // EP each, the first E % EP ranks one more).

MOE_PAIRS = [
    LayoutPair(1, 1, 1, train_ep=2),
    LayoutPair(2, 1, 2, train_ep=2),
    LayoutPair(2, 2, 1, train_ep=2),
    LayoutPair(1, 2, 2, train_ep=4),
    LayoutPair(2, 1, 4, train_ep=2, train_etp=1),
    LayoutPair(1, 1, 2, train_ep=2, train_etp=2),
    LayoutPair(4, 1, 2, train_ep=1, train_etp=2),
    LayoutPair(2, 1, 2, train_ep=2, rollout_ep=True),
    LayoutPair(1, 2, 3, train_ep=4, rollout_ep=True),
]


def _vllm_placement(experts: int, ranks: int, rank: int) -> range:
    """vLLM's linear expert placement, written out from `determine_expert_map`."""
    base, remainder = divmod(experts, ranks)
    start = rank * base + min(rank, remainder)
    return range(start, start + base + (1 if rank < remainder else 0))


def _vllm_expert_tensor(param, hf, layout, rank: int) -> torch.Tensor:
    """vLLM worker `rank`'s rows of one expert in its fused-MoE weights, by `FusedMoE.weight_loader`."""
    tensors = [hf[name] for name in param.hf_names]
    parts = 1 if layout.rollout_ep else layout.rollout_tp
    index = 0 if layout.rollout_ep else rank
    if param.kind == "row":  # w2: the columns of this rank
        return tensors[0].chunk(parts, dim=1)[index]
    return torch.cat([t.chunk(parts)[index] for t in tensors])  # w13: [gate_r; up_r]


def _moe_dims(layout):
    # 4 KV heads and attention heads fit rollout TP 1, 2, 4; rollout TP 3 only with expert parallelism.
    heads = {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 192} if layout.rollout_tp == 3 else {}
    return dims_of("qwen3_moe", vocab_size=300, intermediate_size=384, **heads)


@pytest.mark.parametrize("layout", MOE_PAIRS, ids=str)
def test_each_expert_comes_from_the_rank_holding_it_and_reaches_the_workers_holding_it(layout):
    dims = _moe_dims(layout)
    schedule = build_schedule(build_plan(dims, layout, bucket_mb=0.25), VOCAB_DIVISIBLE_BY)
    ranks = stage_ranks(layout)
    per_ep = dims.num_experts // layout.train_ep
    got = {}
    for bucket in schedule.buckets:
        for piece in bucket.pieces:
            param = piece.param
            if param.expert < 0:
                continue
            sender = ranks[piece.sender - bucket.bucket.pp_rank * layout.stage_senders]
            # The first expert-DP replica's expert-TP rank of the EP rank holding the expert.
            assert sender["expert_dp_rank"] == 0 and sender["ep_rank"] == param.expert // per_ep
            assert sender["etp_rank"] == piece.tp_rank
            held = megatron_block(param, piece.hf_index, dims, layout.expert_tp, piece.tp_rank, VOCAB_DIVISIBLE_BY)
            assert held.start <= piece.start < piece.stop <= held.stop
            got.setdefault(piece.worker, set()).add(param.expert)
    for worker in range(layout.rollout_tp):
        placed = _vllm_placement(dims.num_experts, layout.rollout_tp, worker) if layout.rollout_ep else range(8)
        assert got[worker] == set(placed)
    # Bytes sent ÷ bytes needed is 1.00: every sending rank of every stage together sends what the workers need.
    sent = sum(
        schedule.bytes_sent(sender_rank(layout, pp, index), engines=1)
        for pp in range(layout.train_pp)
        for index in range(layout.stage_senders)
    )
    assert sent == sum(schedule.bytes_needed(worker) for worker in range(layout.rollout_tp)) > 0


@pytest.mark.parametrize("layout", MOE_PAIRS, ids=str)
def test_workers_assemble_the_expert_rows_vllm_would_load_and_checksum_them(layout):
    dims = _moe_dims(layout)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, layout, bucket_mb=0.25)
    schedule = build_schedule(plan, VOCAB_DIVISIBLE_BY)
    shards = megatron_shards(plan, hf)
    records, experts = [], 0
    for worker in range(layout.rollout_tp):
        records.append(LoadedChecksums("float32"))
        rank_layout = VllmRankLayout(dims, layout.rollout_tp, worker, expert_parallel=layout.rollout_ep)
        for bucket in schedule.buckets:
            if not bucket.held[worker]:  # nothing for it: experts placed on other workers (receive_rank_shards)
                assert not any(piece.worker == worker for piece in bucket.pieces)
                continue
            flat = receive_bucket(bucket, worker, _Wire(_sent(schedule, bucket, worker, shards)), torch.device("cpu"))
            received = recorded(unpack(flat, bucket.received[worker]), records[-1], rank_layout)
            for param, (name, tensor) in zip(bucket.held[worker], received, strict=True):
                if param.expert < 0:
                    if not layout.rollout_ep:
                        assert torch.equal(tensor, _vllm_rank_tensor(param, hf, dims, layout.rollout_tp, worker))
                    continue
                leaf = "w13_weight" if param.kind == "gate_up" else "w2_weight"
                assert name == f"{param.hf_names[0].rsplit('.', 2)[0]}.{leaf}"
                assert torch.equal(tensor, _vllm_expert_tensor(param, hf, layout, worker)), (name, worker)
                if layout.expert_tp == layout.rollout_tp and not layout.rollout_ep:  # the per-rank sync's agrees
                    shard = shards[param.megatron_name][worker]
                    vllm_name, per_rank = to_vllm_rank(param, shard, dims, layout.rollout_tp)
                    assert vllm_name == name and torch.equal(per_rank, tensor)
                experts += 1
    assert experts == 2 * dims.num_layers * dims.num_experts * (1 if layout.rollout_ep else layout.rollout_tp)
    expected = {name: tensor_checksum(tensor, torch.float32) for name, tensor in hf.items()}
    check_checksums(expected, records, dtype="float32", layout=plan.layout, engine="e")


def test_vllm_places_whole_experts_linearly_with_expert_parallelism():
    """8 experts over 3 ranks: vLLM's `determine_expert_map` gives 3, 3, 2."""
    from megarl.bridge.schedule import vllm_expert_range

    dims = dims_of("qwen3_moe")
    assert [list(vllm_expert_range(dims, 3, r)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [vllm_expert_range(dims, 3, r) for r in range(3)] == [_vllm_placement(8, 3, r) for r in range(3)]


def test_expert_layouts_that_do_not_fit_are_refused_and_other_syncs_refuse_split_experts():
    from megarl.bridge.plan import check_layout

    dims = dims_of("qwen3_moe")
    with pytest.raises(ValueError, match="train EP=3 does not divide num_experts=8"):
        check_layout(dims, LayoutPair(1, 1, 1, train_ep=3))
    with pytest.raises(ValueError, match="rollout TP=4 does not divide moe_intermediate_size=66"):
        check_layout(dims_of("qwen3_moe", moe_intermediate_size=66), LayoutPair(1, 1, 4))
    check_layout(dims_of("qwen3_moe", moe_intermediate_size=66), LayoutPair(1, 1, 4, rollout_ep=True))  # whole experts
    with pytest.raises(ValueError, match="expert settings on a dense model"):
        check_layout(dims_of("qwen2"), LayoutPair(1, 1, 1, train_ep=2))
    with pytest.raises(ValueError, match="use the collective transport"):
        LayoutPair(1, 1, 1, train_ep=2).refuse_split_experts("the per-rank weight sync")
    LayoutPair(2, 1, 2).refuse_split_experts("the per-rank weight sync")  # experts cut like the dense weights
