"""The shard sync across processes, for the layout pairs train (TP, PP) ∈ {(1, 1), (2, 1), (1, 2),
(2, 2), (4, 1)} → rollout TP ∈ {1, 2} (every pair of {1,2,4}×{1,2} → {1,2,4} is checked without
processes in tests/unit/bridge/test_shard_schedule.py): a spawned trainer world loads an HF checkpoint into Megatron, and every rank
sends, over a gloo sync group, each receiver thread of this process (the workers of one rollout
engine) exactly the pieces of its own shards that the worker's vLLM TP shard needs (the planner's
schedule, `plan.build_schedule`); each worker assembles its per-rank tensors bucket by bucket. The
test process hosts each sync group's store, listening before any rank joins.

- The sync check is exact: the workers' tensors, checksummed as vLLM's loader would take them
  (`checksum.VllmRankLayout`), add up to the checkpoint's checksums, every tensor.
- The bytes each trainer rank sent each receiver equal the schedule's pieces for that pair, and
  all ranks together send each worker exactly what it needs (no full model through rank 0).
- The trainer world carries nothing during the sync (no TP gather), no sender sends to a sender.

Model: a tiny Qwen2 (q/k/v biases), 2 KV groups per TP-2 rank, vocabulary 100 (padded to 128 rows
per TP-2 rank by Megatron: TP rank 1's embedding shard is all padding and is not sent)."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megarl.bridge.checksum import LoadedChecksums, VllmRankLayout, check_checksums, recorded, tensor_checksum
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.schedule import build_schedule, receiver_rank
from megarl.bridge.shard_sync import receive_rank_shards
from megarl.bridge.sync_group import create_weight_sync_group, listen_weight_sync_store
from megarl.models.hf_config import read_model_dims
from megarl.models.layout import VOCAB_DIVISIBLE_BY
from megarl.parallel.spawn import run_distributed

HOST = "127.0.0.1"
TIMEOUT_S = 300
BUCKET_MB = 0.1
ROLLOUT_TPS = (1, 2)
TRAINER_WORLD_CALLS = (
    "send",
    "isend",
    "recv",
    "irecv",
    "broadcast",
    "all_reduce",
    "all_gather",
    "gather",
    "all_gather_into_tensor",
    "batch_isend_irecv",
)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    # Imported here, not at the top: the spawned ranks import this module and need no transformers.
    from megarl.models.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("shard_sync"),
        "qwen2",
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from megarl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("shard_sync_moe"), "qwen3_moe", initializer_range=0.2)


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


def _trainer(model_dir: str, train: LayoutPair, ports: dict[int, int]) -> dict:
    """One trainer rank: per rollout TP, join that sync group (if it sends) and send; what it sent, per receiver."""
    from megarl.bridge.collect import sync_rank
    from megarl.bridge.shard_sync import ShardSender
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import global_named_parameters

    groups = initialize_model_parallel(train.train_tp, train.train_pp, seed=0, ep=train.train_ep, etp=train.train_etp)
    model = build_gpt_model(model_dir, groups)
    load_hf_weights(model, model_dir, groups)
    dims = read_model_dims(model_dir)
    rank = sync_rank(train, groups)
    out = dict(sync_rank=rank, syncs={})
    for rollout_tp, port in ports.items():
        layout = dataclasses.replace(train, rollout_tp=rollout_tp)
        group = None
        if rank is not None:
            group = _CountingGroup(create_weight_sync_group(HOST, port, rank, layout.senders + rollout_tp, TIMEOUT_S))
        plan = build_plan(dims, layout, bucket_mb=BUCKET_MB)
        sender = ShardSender(plan, lambda: global_named_parameters(model, groups), groups, group)
        with _TrainerWorldCalls() as world:
            stats = sender.send()
        out["syncs"][rollout_tp] = dict(
            sent=dict(group.sent) if group else {},
            trainer_world_calls=world.calls,
            bytes=stats.bytes_sent,
            peak=stats.peak_buffer_bytes,
        )
    return out


def _receiver(port: int, plan, worker: int) -> LoadedChecksums:
    """Rollout worker `worker` of one engine: join the group, receive its per-rank tensors, checksum
    them as vLLM's loader takes them."""
    layout = plan.layout
    group = create_weight_sync_group(
        HOST, port, receiver_rank(layout, 0, worker), layout.senders + layout.rollout_tp, TIMEOUT_S
    )
    record = LoadedChecksums("float32")
    for _ in recorded(
        receive_rank_shards(group, plan, worker, torch.device("cpu")),
        record,
        VllmRankLayout(plan.dims, layout.rollout_tp, worker),
    ):
        pass
    return record


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


@pytest.mark.parametrize(
    "tp,pp,rollout_tps",
    [(1, 1, ROLLOUT_TPS), (2, 1, (*ROLLOUT_TPS, 4)), (1, 2, ROLLOUT_TPS), (2, 2, ROLLOUT_TPS), (4, 1, ROLLOUT_TPS)],
)
def test_every_rank_sends_each_worker_the_pieces_of_its_shard(qwen2, tp, pp, rollout_tps):
    """Rollout TP 4 (each train TP-2 shard split over two workers) once: four receiver threads, no
    extra trainer processes."""
    _check_shard_sync(qwen2, LayoutPair(tp, pp, 1), rollout_tps)


@pytest.mark.parametrize(
    "train",
    [LayoutPair(1, 1, 1, train_ep=2), LayoutPair(2, 1, 1, train_ep=2), LayoutPair(1, 2, 1, train_ep=2, train_etp=1)],
    ids=str,
)
def test_each_ep_rank_sends_the_experts_it_holds(qwen3_moe, train):
    """Qwen3-MoE (8 experts): EP 2 (each rank 4 experts, the DP replicas' copies of the dense weights
    not sent), EP 2 × expert TP 2 beside TP 2 (4 ranks a stage: the dense weights from the first two,
    the experts from all four), and PP 2: every expert tensor arrives exactly (checksums), from the
    rank holding it, and bytes sent ÷ bytes needed is 1."""
    _check_shard_sync(qwen3_moe, train, ROLLOUT_TPS)


def _check_shard_sync(model_dir: Path, train: LayoutPair, rollout_tps) -> None:
    dims = read_model_dims(model_dir)
    expected = {name: tensor_checksum(tensor, torch.float32) for name, tensor in _checkpoint(model_dir).items()}
    # Listening before any rank starts, as `megarl check-sync` does: no rank waits out TCPStore's backoff.
    stores = {r: listen_weight_sync_store(HOST, train.senders + r, TIMEOUT_S) for r in rollout_tps}
    ports = {r: store.port for r, store in stores.items()}
    plans = {r: build_plan(dims, dataclasses.replace(train, rollout_tp=r), bucket_mb=BUCKET_MB) for r in rollout_tps}
    receivers = [(r, worker) for r in rollout_tps for worker in range(r)]
    world = train.train_pp * math.lcm(train.train_tp, train.expert_tp * train.train_ep)
    with ThreadPoolExecutor(max_workers=1 + len(receivers)) as pool:
        trainers = pool.submit(run_distributed, _trainer, world, str(model_dir), train, ports, timeout_s=TIMEOUT_S)
        received = {(r, worker): pool.submit(_receiver, ports[r], plans[r], worker) for r, worker in receivers}
        per_rank = trainers.result()
        records = {key: future.result() for key, future in received.items()}
    assert sorted(r["sync_rank"] for r in per_rank if r["sync_rank"] is not None) == list(range(train.senders))
    for rollout_tp, plan in plans.items():
        check_checksums(
            expected,
            [records[rollout_tp, w] for w in range(rollout_tp)],
            dtype="float32",
            layout=plan.layout,
            engine=f"rollout TP {rollout_tp}",
        )
        assert len(plan.buckets) > train.train_pp
        schedule = build_schedule(plan, VOCAB_DIVISIBLE_BY)
        for rank in per_rank:
            sync, me = rank["syncs"][rollout_tp], rank["sync_rank"]
            assert sync["trainer_world_calls"] == []  # no gather: TP rank 1 sends nothing to TP rank 0
            if me is None:  # a replica's copy: not sent
                assert sync["bytes"] == 0
                continue
            scheduled = defaultdict(int)
            for _, piece in schedule.sent_by(me):
                scheduled[receiver_rank(plan.layout, 0, piece.worker)] += piece.numel * 4
            assert sync["sent"] == dict(scheduled)  # to the receivers only, each exactly its pieces
            assert sync["bytes"] == schedule.bytes_sent(me, engines=1) > 0
            # Pieces go as views of the parameters where they can; copies of two buckets' pieces at most.
            assert sync["peak"] <= 2 * max(
                sum(p.numel * 4 for t, p in schedule.sent_by(me) if t == tag) for tag in range(len(plan.buckets))
            )
        needed = sum(schedule.bytes_needed(worker) for worker in range(rollout_tp))
        assert sum(rank["syncs"][rollout_tp]["bytes"] for rank in per_rank) == needed  # each element once
