"""The shard sync's wire format without processes: every TP rank cuts its own shards of a bucket into
the pieces of `shard_schedule` (`shard_send.message_tensors`), and the receiver's `receive_bucket`,
receiving each piece in place, must rebuild the checkpoint's tensors exactly from them. The
schedule sends every HF element once (replicated norms from TP rank 0 only, no vocabulary padding),
each bucket from its own stage's ranks, and only qkv parts are copied on the way."""

from __future__ import annotations

import pytest
import torch
from bridge_emulate import VOCAB_DIVISIBLE_BY, dims_of, megatron_shards, random_hf_tensors

from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.shard_send import message_tensors
from megarl.bridge.shard_receive import receive_bucket, receiver_rank, sender_rank, shard_schedule
from megarl.bridge.protocol import unpack

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]


class _Wire:
    """`receive_bucket`'s receive: each sender's tensors in send order, copied into the destination."""

    def __init__(self, sent):
        self.sent = sent

    def __call__(self, destination: torch.Tensor, sender: int):
        destination.copy_(next(self.sent[sender]))
        return self

    def wait(self) -> None:
        pass


def _local_shards(plan, shards, pp_rank: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """What trainer rank (pp_rank, tp_rank) holds: its TP shard of its stage's parameters (contiguous,
    as Megatron's parameters are)."""
    return {p.megatron_name: shards[p.megatron_name][tp_rank].contiguous() for p in plan.params if p.pp_rank == pp_rank}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_packed_shards_assemble_into_the_checkpoint(arch, tp, pp):
    dims = dims_of(arch)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(tp, pp, 1), bucket_mb=0.25)
    shards = megatron_shards(plan, hf)
    schedule = shard_schedule(plan, VOCAB_DIVISIBLE_BY)
    assert len(schedule) == len(plan.buckets) > pp
    seen = set()
    for bucket_shards in schedule:
        sent = {}
        for message in bucket_shards.messages:
            pp_rank, tp_rank = divmod(message.sender, tp)
            tensors = message_tensors(plan, message, _local_shards(plan, shards, pp_rank, tp_rank), VOCAB_DIVISIBLE_BY)
            assert all(not copied or piece.param.kind == "qkv"  # only qkv parts are copied
                       for (_, copied), piece in zip(tensors, message.pieces))
            sent[message.sender] = iter(tensor for tensor, _ in tensors)
        flat = receive_bucket(bucket_shards, _Wire(sent), torch.device("cpu"))
        for name, tensor in unpack(flat, bucket_shards.bucket.metadata):
            assert torch.equal(tensor, hf[name]), name
            seen.add(name)
    assert seen == set(hf)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_every_element_travels_once_from_its_own_stage(tp, pp):
    dims = dims_of("qwen2", vocab_size=300)  # TP 4: the last rank's padded rows lie past the vocabulary
    layout = LayoutPair(tp, pp, 2)
    plan = build_plan(dims, layout, bucket_mb=0.25)
    for bucket_shards in shard_schedule(plan, VOCAB_DIVISIBLE_BY):
        bucket = bucket_shards.bucket
        assert bucket_shards.numel == bucket.metadata.numel  # no padding, no duplicate
        senders = [m.sender for m in bucket_shards.messages]
        assert senders == sorted(set(senders))
        assert {s // tp for s in senders} == {bucket.pp_rank}
        for message in bucket_shards.messages:
            for piece in message.pieces:
                assert sender_rank(layout, bucket.pp_rank, piece.tp_rank) == message.sender
                assert piece.param.needs_tp_gather or piece.tp_rank == 0
        per_param = {}
        for message in bucket_shards.messages:
            for piece in message.pieces:
                per_param.setdefault(piece.param.megatron_name, []).append(piece.numel)
        assert [p.megatron_name for p in bucket.params] == list(per_param)  # plan order, every param
        for param in bucket.params:
            assert sum(per_param[param.megatron_name]) == param.numel


def test_vocabulary_shards_past_the_vocabulary_are_not_sent():
    dims = dims_of("qwen2", vocab_size=300)  # padded to 512 at TP 4: 128 rows per rank
    plan = build_plan(dims, LayoutPair(4, 1, 1), bucket_mb=0.25)
    embedding = next(s for s in shard_schedule(plan, VOCAB_DIVISIBLE_BY) if s.bucket.params[0].kind == "vocab")
    rows = {p.tp_rank: p.shape[0] for m in embedding.messages for p in m.pieces if p.param.kind == "vocab"}
    assert rows == {0: 128, 1: 128, 2: 44}  # rank 3 holds only padding: no slot


def test_a_model_padded_otherwise_is_refused():
    dims = dims_of("qwen2")
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(2, 1, 1), bucket_mb=0.25)
    shards = megatron_shards(plan, hf)  # padded with VOCAB_DIVISIBLE_BY (128 per rank at TP 2)
    message = next(m for s in shard_schedule(plan, 64) for m in s.messages if m.pieces[0].param.kind == "vocab")
    with pytest.raises(ValueError, match="vocab_divisible_by=64"):
        message_tensors(plan, message, _local_shards(plan, shards, 0, 0), 64)


def test_group_ranks_put_senders_first():
    layout = LayoutPair(train_tp=2, train_pp=2, rollout_tp=2)
    assert [sender_rank(layout, pp, tp) for pp in range(2) for tp in range(2)] == [0, 1, 2, 3]
    assert [receiver_rank(layout, k, r) for k in range(2) for r in range(2)] == [4, 5, 6, 7]
