"""Colocated shared-memory rings, per device (`megarl.bridge.ring_routes`): two spawned trainer ranks
(train TP 2) stand for two devices, and in each rank's process a reader thread stands for the
engine worker on that rank's device (colocated: same GPU for CUDA IPC, same node for shared memory,
which use one ring). Every worker is handed the ring `route_rings` names, which must be the ring of
its own rank, joined by it alone; what it read must be exactly the actor's weights (the bridge's
exact check, `bridge.checksum`):

- rollout TP 2 (one engine over both devices): "per_rank", each rank streams its own shards in
  vLLM's per-rank layout; worker r's TP blocks, summed over the two workers, are the actor's tensors.
- rollout TP 1 (two engines, one per device): "every_rank", both ranks assemble the gathered HF
  buckets; each engine loaded every tensor whole.

No vLLM here (the engines' side of the rings runs in the e2e trainer tests): a tiny Qwen2 loaded
into Megatron, no training, small buckets so each ring cycles through both slots."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megarl.bridge.checksum import LoadedChecksums, VllmRankLayout, check_checksums, combine, rank_checksums, recorded
from megarl.bridge.per_rank import PerRankSender
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.ring_routes import route_rings
from megarl.bridge.shared_ring import HOST, read_ring
from megarl.bridge.sync import WeightSender
from megarl.bridge.transports.shared_memory import SharedMemoryTransport
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

TRAIN_TP = 2
TIMEOUT_S = 120
BUCKET_MB = 0.05
"""Small buckets: each ring streams several through its two slots."""


def _rank(model_dir: str) -> dict:
    """One trainer rank and the engine worker on its device: for rollout TP 2 then 1, open this rank's
    ring, learn every rank's (the driver's part), read the one the routes give this device's worker
    while sending; what was read and who joined this rank's ring."""
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import global_named_parameters

    groups = initialize_model_parallel(TRAIN_TP, 1, seed=0)
    model = build_gpt_model(model_dir, groups)
    load_hf_weights(model, model_dir, groups)
    named = lambda: global_named_parameters(model, groups)  # noqa: E731
    dims = read_model_dims(model_dir)
    grid = dict(rank=dist.get_rank(), tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank,
                dp_size=groups.dp_size)  # as `PolicyWorker.grid`
    grids = [None] * dist.get_world_size()
    dist.all_gather_object(grids, grid)
    rank = dist.get_rank()
    out = {}
    for rollout_tp in (2, 1):
        plan = build_plan(dims, LayoutPair(TRAIN_TP, 1, rollout_tp), bucket_mb=BUCKET_MB)
        routes = route_rings(grids, engines=len(grids) // rollout_tp, rollout_tp=rollout_tp, colocated=True,
                             per_rank=True)
        transport = SharedMemoryTransport(readers=routes.readers[rank], timeout_s=TIMEOUT_S)
        if routes.per_rank:
            sender = PerRankSender(plan, named, groups, transport)
        else:
            sender = WeightSender(plan, named, groups, transport, every_rank=True)
        ring = transport.begin()
        rings = [None] * dist.get_world_size()
        dist.all_gather_object(rings, ring)
        engine, worker = divmod(rank, rollout_tp)  # colocated: the worker on this rank's bundle
        (mine,) = routes.engine_rings(engine, rings)[worker]
        record = LoadedChecksums("float32")
        layout = VllmRankLayout(dims, rollout_tp, worker) if routes.per_rank else None
        with ThreadPoolExecutor(max_workers=1) as reader:
            read = reader.submit(read_ring, mine, f"worker {worker} of engine {engine}", torch.device("cpu"),
                                 lambda tensors: [None for _ in recorded(tensors, record, layout)])
            stats = sender.send()
            read.result(timeout=TIMEOUT_S)
        store = dist.TCPStore(HOST, ring.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        out[rollout_tp] = dict(
            mode=routes.mode, engine=engine, record=record, read_port=mine.port, own_port=ring.port,
            joined=store.add(ring.key("joined"), 0), reader_pid=int(store.get(ring.key("pid/0"))), pid=os.getpid(),
            buckets=stats.buckets,
        )
    out["checksums"] = rank_checksums(plan, named(), groups, "float32")
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("rings"), "qwen2", hidden_size=64, intermediate_size=128,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return run_distributed(_rank, TRAIN_TP, str(model_dir), timeout_s=TIMEOUT_S * 2)


@pytest.mark.parametrize("rollout_tp, mode", [(2, "per_rank"), (1, "every_rank")])
def test_each_devices_worker_reads_only_its_own_ranks_ring(ranks, rollout_tp, mode):
    for rank in ranks:
        sync = rank[rollout_tp]
        assert sync["mode"] == mode
        assert sync["read_port"] == sync["own_port"]  # the routes handed it this rank's ring ...
        assert (sync["joined"], sync["reader_pid"]) == (1, sync["pid"])  # ... and nobody else joined it
        assert sync["buckets"] >= 3  # both slots reused


@pytest.mark.parametrize("rollout_tp", [2, 1])
def test_the_workers_loaded_the_actors_weights_bit_for_bit(ranks, rollout_tp):
    expected = combine(rank["checksums"] for rank in ranks)
    layout = LayoutPair(TRAIN_TP, 1, rollout_tp)
    by_engine: dict[int, list] = {}
    for rank in ranks:  # in rank order: worker r of each engine
        by_engine.setdefault(rank[rollout_tp]["engine"], []).append(rank[rollout_tp]["record"])
    assert len(by_engine) == TRAIN_TP // rollout_tp
    for engine, records in by_engine.items():
        check_checksums(expected, records, dtype="float32", layout=layout, engine=f"rollout engine {engine}")
