"""The shard sync across processes: a spawned trainer world (train TP, PP) loads an HF checkpoint
into Megatron, and every rank sends its own TP shards over a gloo sync group straight to receiver
threads of this process (one rollout engine of TP 1, then one of TP 2), which receive each piece in
place in the HF tensors, bucket by bucket. Every receiver must get exactly the checkpoint's tensors; the trainer
world carries nothing during the sync (no TP gather: TP rank 1 sends nothing to TP rank 0), no
sender sends anything to another sender, each sender sends every receiver exactly its own shards,
and together they send each HF element once per receiver.

Model: a tiny Qwen2 (q/k/v biases), 2 KV groups per TP-2 rank, vocabulary 100 (padded to 128 rows
per TP-2 rank by Megatron: TP rank 1's embedding shard is all padding and is not sent)."""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megarl.bridge.plan import LayoutPair, build_plan
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import free_port, run_distributed
from megarl.bridge.shard_receive import receive_shards, receiver_rank, sender_rank, shard_schedule
from megarl.bridge.sync_group import create_weight_sync_group

HOST = "127.0.0.1"
TIMEOUT_S = 300
BUCKET_MB = 0.1
ROLLOUT_TPS = (1, 2)
TRAINER_WORLD_CALLS = ("send", "isend", "recv", "irecv", "broadcast", "all_reduce", "all_gather", "gather",
                       "all_gather_into_tensor", "batch_isend_irecv")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("shard_send"), "qwen2", hidden_size=256, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, initializer_range=0.2,
    )


class _CountingGroup:
    """The sync group as the sender sees it, counting the bytes sent to each group rank."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.sent: dict[int, int] = defaultdict(int)

    def rank(self) -> int:
        return self.group.rank()

    def size(self) -> int:
        return self.group.size()

    def send(self, tensors, dst: int, tag: int):
        self.sent[dst] += sum(t.nbytes for t in tensors)
        return self.group.send(tensors, dst, tag)


class _TrainerWorldCalls:
    """Calls of the trainer world's collectives and point-to-point operations while it is entered."""

    def __init__(self):
        self.calls: list[str] = []
        self._originals = {name: getattr(dist, name) for name in TRAINER_WORLD_CALLS}

    def __enter__(self):
        for name, original in self._originals.items():
            setattr(dist, name, self._counted(name, original))
        return self

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _trainer(model_dir: str, tp: int, pp: int, ports: dict[int, int]) -> dict:
    """One trainer rank: per rollout TP, join that sync group and send; what it sent, per receiver."""
    from megarl.bridge.shard_send import ShardSender
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import global_named_parameters

    groups = initialize_model_parallel(tp, pp, seed=0)
    model = build_gpt_model(model_dir, groups)
    load_hf_weights(model, model_dir, groups)
    dims = read_model_dims(model_dir)
    out = dict(tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, syncs={})
    for rollout_tp, port in ports.items():
        layout = LayoutPair(tp, pp, rollout_tp)
        rank = sender_rank(layout, groups.pp_rank, groups.tp_rank)
        group = _CountingGroup(create_weight_sync_group(HOST, port, rank, tp * pp + rollout_tp, TIMEOUT_S))
        plan = build_plan(dims, layout, bucket_mb=BUCKET_MB)
        sender = ShardSender(plan, lambda: global_named_parameters(model, groups), groups, group)
        with _TrainerWorldCalls() as world:
            stats = sender.send()
        out["syncs"][rollout_tp] = dict(sent=dict(group.sent), trainer_world_calls=world.calls,
                                        bytes=stats.bytes_sent, peak=stats.peak_buffer_bytes)
    return out


def _receiver(port: int, plan, rank: int, expected: dict[str, torch.Tensor]) -> list[str]:
    """One rollout worker: join the group, assemble every tensor, compare it with the checkpoint."""
    group = create_weight_sync_group(HOST, port, rank, plan.layout.train_tp * plan.layout.train_pp
                                     + plan.layout.rollout_tp, TIMEOUT_S)
    names = []
    for name, tensor in receive_shards(group, plan, torch.device("cpu")):
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
        names.append(name)
    return names


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_every_rank_sends_its_own_shards_and_receivers_assemble_the_checkpoint(qwen2, tp, pp):
    dims = read_model_dims(qwen2)
    expected = _checkpoint(qwen2)
    ports = {rollout_tp: free_port(HOST) for rollout_tp in ROLLOUT_TPS}
    plans = {r: build_plan(dims, LayoutPair(tp, pp, r), bucket_mb=BUCKET_MB) for r in ROLLOUT_TPS}
    receivers = [(r, worker) for r in ROLLOUT_TPS for worker in range(r)]
    with ThreadPoolExecutor(max_workers=1 + len(receivers)) as pool:
        trainers = pool.submit(run_distributed, _trainer, tp * pp, str(qwen2), tp, pp, ports, timeout_s=TIMEOUT_S)
        received = {
            (r, worker): pool.submit(_receiver, ports[r], plans[r], receiver_rank(plans[r].layout, 0, worker), expected)
            for r, worker in receivers
        }
        per_rank = trainers.result()
        names = {key: future.result() for key, future in received.items()}
    for key, got in names.items():
        assert sorted(got) == sorted(expected), key  # every tensor exactly once
    senders = tp * pp
    for rollout_tp, plan in plans.items():
        assert len(plan.buckets) > pp
        schedule = shard_schedule(plan)
        model_bytes = sum(bucket.nbytes for bucket in plan.buckets)
        for rank in per_rank:
            sync = rank["syncs"][rollout_tp]
            me = sender_rank(plan.layout, rank["pp_rank"], rank["tp_rank"])
            own = sum(m.numel * 4 for shards in schedule for m in shards.messages if m.sender == me)
            assert sync["trainer_world_calls"] == []  # no gather: TP rank 1 sends nothing to TP rank 0
            assert sync["sent"] == {receiver: own for receiver in range(senders, senders + rollout_tp)}
            assert sync["bytes"] == own > 0
            # Pieces are sent as views of the parameters; only qkv parts are copied, two buckets' at most.
            qkv = [sum(p.numel * 4 for p in m.pieces if p.param.kind == "qkv")
                   for shards in schedule for m in shards.messages if m.sender == me]
            assert sync["peak"] <= 2 * max(qkv)
        assert sum(rank["syncs"][rollout_tp]["bytes"] for rank in per_rank) == model_bytes  # each element once
