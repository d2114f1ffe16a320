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
from bridge_emulate import VOCAB_DIVISIBLE_BY, dims_of, megatron_shards, random_hf_tensors

from megarl.bridge.checksum import LoadedChecksums, VllmRankLayout, check_checksums, recorded, tensor_checksum
from megarl.bridge.convert import to_vllm_rank
from megarl.bridge.plan import LayoutPair, build_plan, build_schedule, megatron_block, receiver_rank, sender_rank
from megarl.bridge.protocol import unpack
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
