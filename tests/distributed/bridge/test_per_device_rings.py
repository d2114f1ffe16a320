"""Colocated shared-memory rings, per device (`megarl.bridge.ring_routes`): two spawned trainer ranks
stand for two devices, and in each rank's process a reader thread stands for the engine worker on
that rank's device (colocated: same GPU for CUDA IPC, same node for shared memory, which use one
ring). Every worker is handed the ring `route_rings` names, which must be the ring of its own rank,
joined by it alone; what it read, checksummed as vLLM's per-rank loader takes it
(`checksum.VllmRankLayout`), must add up to the actor's weights exactly (`bridge.checksum`):

- train TP 2 → rollout TP 2 (one engine over both devices): "per_rank", each rank streams its own
  shards in vLLM's per-rank layout.
- train TP 2 → rollout TP 1 (two engines, one per device; TP mismatch) and train PP 2 → rollout
  TP 1 and 2 (a rank holds one stage): "scheduled", every rank of DP replica 0 sends each host
  exactly the planner's pieces for its worker, point to point in the trainer world, and each rank
  streams its worker's assembled per-rank tensors. The bytes each rank sends each other rank equal
  the schedule's, the trainer world carries nothing else (no gather), and no rank sends a piece
  whose worker is not on the receiving rank's device.
- split, train TP 2 → one rollout TP 1 engine: "scheduled" too, the engine's worker reading rank
  0's ring while rank 1 only sends its pieces (not the full model through rank 0: rank 0 receives
  rank 1's shards' pieces only, which is what the worker needs of them).

No vLLM here (the engines' side of the rings runs in the e2e trainer tests): a tiny Qwen2 loaded
into Megatron, no training, small buckets so each ring cycles through both slots."""

from __future__ import annotations

import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megarl.bridge.checksum import LoadedChecksums, VllmRankLayout, check_checksums, combine, rank_checksums, recorded
from megarl.bridge.per_rank import PerRankSender
from megarl.bridge.plan import LayoutPair, build_plan, build_schedule, sender_rank
from megarl.bridge.ring_routes import route_rings
from megarl.bridge.scheduled_ring import ScheduledRingSender
from megarl.bridge.shared_ring import HOST, read_ring
from megarl.bridge.transports.shared_memory import SharedMemoryTransport
from megarl.config.memory import VOCAB_DIVISIBLE_BY
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

WORLD = 2
TIMEOUT_S = 120
BUCKET_MB = 0.05
"""Small buckets: each ring streams several through its two slots."""
LAYOUTS = {(2, 1): ((2, True), (1, True), (1, False)), (1, 2): ((1, True), (2, True))}
"""Train (TP, PP) → the (rollout TP, colocated) syncs from it; split: one engine."""
GATHERS = ("broadcast", "all_reduce", "all_gather", "gather", "all_gather_into_tensor", "send", "recv")


class _TrainerWorld:
    """The trainer world's traffic while entered: bytes each `batch_isend_irecv` sends to each rank,
    and the calls of anything else (a gather would show here)."""

    def __init__(self):
        self.sent: dict[int, int] = defaultdict(int)
        self.other: list[str] = []
        self._originals = {name: getattr(dist, name) for name in GATHERS + ("batch_isend_irecv",)}

    def __enter__(self):
        for name in GATHERS:
            setattr(dist, name, self._other(name, self._originals[name]))
        dist.batch_isend_irecv = self._batch
        return self

    def _other(self, name, original):
        def called(*args, **kwargs):
            self.other.append(name)
            return original(*args, **kwargs)

        return called

    def _batch(self, ops):
        for op in ops:
            if op.op.__name__ == "isend":
                self.sent[op.peer] += op.tensor.nbytes
        return self._originals["batch_isend_irecv"](ops)

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _rank(model_dir: str) -> dict:
    """One trainer rank, in each train layout in turn (one spawn for all: megatron-core's grid torn
    down between them, as its own tests do)."""
    from megatron.core import parallel_state

    out = {}
    for tp, pp in LAYOUTS:
        out[tp, pp] = _layout(model_dir, tp, pp)
        parallel_state.destroy_model_parallel()
    return out


def _layout(model_dir: str, tp: int, pp: int) -> dict:
    """One trainer rank and the engine worker on its device: for each rollout TP, open this rank's
    ring, learn every rank's (the driver's part), read the one the routes give this device's worker
    while sending; what was read, what was sent, and who joined this rank's ring."""
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import global_named_parameters

    groups = initialize_model_parallel(tp, pp, seed=0)
    model = build_gpt_model(model_dir, groups)
    load_hf_weights(model, model_dir, groups)
    named = lambda: global_named_parameters(model, groups)  # noqa: E731
    dims = read_model_dims(model_dir)
    grid = dict(rank=dist.get_rank(), tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank,
                dp_size=groups.dp_size)  # as `PolicyWorker.grid`
    grids = [None] * dist.get_world_size()
    dist.all_gather_object(grids, grid)
    rank = dist.get_rank()
    out = dict(tp_rank=groups.tp_rank, pp_rank=groups.pp_rank)
    for rollout_tp, colocated in LAYOUTS[tp, pp]:
        plan = build_plan(dims, LayoutPair(tp, pp, rollout_tp), bucket_mb=BUCKET_MB)
        routes = route_rings(grids, engines=len(grids) // rollout_tp if colocated else 1, rollout_tp=rollout_tp,
                             colocated=colocated, per_rank=True)
        readers = routes.readers[rank]
        transport = SharedMemoryTransport(readers=readers, timeout_s=TIMEOUT_S) if readers else None
        if routes.per_rank:
            sender = PerRankSender(plan, named, groups, transport)
        else:
            sender = ScheduledRingSender(plan, named, groups, routes, transport)
        ring = sender.begin()
        rings = [None] * dist.get_world_size()
        dist.all_gather_object(rings, ring)
        # Colocated: the worker on this rank's bundle; split (one engine): worker `rank`, read here.
        engine, worker = divmod(rank, rollout_tp) if colocated else (0, rank)
        sync = out[rollout_tp, colocated] = dict(mode=routes.mode, engine=engine, readers=readers)
        with ThreadPoolExecutor(max_workers=1) as reader, _TrainerWorld() as world:
            if worker < rollout_tp:
                (mine,) = routes.engine_rings(engine, rings)[worker]
                record = LoadedChecksums("float32")
                layout = VllmRankLayout(dims, rollout_tp, worker)
                read = reader.submit(read_ring, mine, f"worker {worker} of engine {engine}", torch.device("cpu"),
                                     lambda tensors: [None for _ in recorded(tensors, record, layout)])
            stats = sender.send()
            if worker < rollout_tp:
                read.result(timeout=TIMEOUT_S)
        sync.update(bytes=stats.bytes_sent, sent=dict(world.sent), other=world.other)
        if worker < rollout_tp:
            store = dist.TCPStore(HOST, ring.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
            sync.update(record=record, read_port=mine.port, own_port=ring.port, joined=store.add(ring.key("joined"), 0),
                        reader_pid=int(store.get(ring.key("pid/0"))), pid=os.getpid(), buckets=stats.buckets)
    out["checksums"] = rank_checksums(plan, named(), groups, "float32")
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rings"), "qwen2", hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def worlds(model_dir):
    ranks = run_distributed(_rank, WORLD, str(model_dir), timeout_s=TIMEOUT_S * 2)
    return {layout: [rank[layout] for rank in ranks] for layout in LAYOUTS}


CASES = [((2, 1), 2, True, "per_rank"), ((2, 1), 1, True, "scheduled"), ((1, 2), 1, True, "scheduled"),
         ((1, 2), 2, True, "scheduled"), ((2, 1), 1, False, "scheduled")]


@pytest.mark.parametrize("train, rollout_tp, colocated, mode", CASES)
def test_each_workers_ring_is_hosted_by_the_rank_the_routes_name(worlds, train, rollout_tp, colocated, mode):
    for rank, out in enumerate(worlds[train]):
        sync = out[rollout_tp, colocated]
        assert sync["mode"] == mode
        if not colocated and rank >= rollout_tp:
            assert sync["readers"] == 0  # split: the ranks past the engine's workers only send
            continue
        assert sync["read_port"] == sync["own_port"]  # the routes handed it this rank's ring ...
        assert (sync["joined"], sync["reader_pid"]) == (1, sync["pid"])  # ... and nobody else joined it
        assert sync["buckets"] >= 3  # both slots reused


@pytest.mark.parametrize("train, rollout_tp, colocated, mode", CASES)
def test_the_workers_loaded_the_actors_weights_bit_for_bit(worlds, train, rollout_tp, colocated, mode):
    ranks = worlds[train]
    expected = combine(rank["checksums"] for rank in ranks)
    layout = LayoutPair(*train, rollout_tp)
    by_engine: dict[int, list] = {}
    for rank in ranks:  # in rank order: worker r of each engine
        sync = rank[rollout_tp, colocated]
        if "record" in sync:
            by_engine.setdefault(sync["engine"], []).append(sync["record"])
    assert len(by_engine) == (WORLD // rollout_tp if colocated else 1)
    for engine, records in by_engine.items():
        check_checksums(expected, records, dtype="float32", layout=layout, engine=f"rollout engine {engine}")


@pytest.mark.parametrize("train, rollout_tp, colocated",
                         [(train, tp, colocated) for train, tp, colocated, mode in CASES if mode == "scheduled"])
def test_each_rank_sends_only_the_schedules_pieces_for_each_rings_worker(model_dir, worlds, train, rollout_tp,
                                                                        colocated):
    layout = LayoutPair(*train, rollout_tp)
    schedule = build_schedule(build_plan(read_model_dims(model_dir), layout, bucket_mb=BUCKET_MB), VOCAB_DIVISIBLE_BY)
    rings = WORLD // rollout_tp if colocated else 1  # rings per worker: one per engine, split one for all
    total = 0
    for rank, out in enumerate(worlds[train]):
        sync = out[rollout_tp, colocated]
        me = sender_rank(layout, out["pp_rank"], out["tp_rank"])
        scheduled = defaultdict(int)  # host rank -> bytes of the pieces for the worker reading its ring
        for _, piece in schedule.sent_by(me):
            for engine in range(rings):
                host = engine * rollout_tp + piece.worker
                if host != rank:  # a piece for this rank's own ring is copied, not sent
                    scheduled[host] += piece.numel * 4
        assert sync["other"] == []  # no gather, no broadcast: the pieces alone
        assert sync["sent"] == dict(scheduled)
        assert sync["bytes"] == schedule.bytes_sent(me, rings) > 0
        total += sync["bytes"]
        print(f"train TP{train[0]}/PP{train[1]} → rollout TP{rollout_tp} ({'colocated' if colocated else 'split'}): "
              f"rank {rank} sent {sum(sync['sent'].values())} B to other ranks, {sync['bytes']} B scheduled in all")
    # All ranks together send each ring's workers exactly what they need, each element once.
    assert total == rings * sum(schedule.bytes_needed(worker) for worker in range(rollout_tp))
