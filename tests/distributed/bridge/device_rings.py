"""The per-device ring syncs of a two-rank trainer world, as `test_per_device_rings.py` (shared memory
on CPU) and `tests/gpu/test_scheduled_ring_cuda.py` (CUDA IPC on two GPUs) drive and check them:
each trainer rank hosts its ring, the engine worker on its device reads the ring `route_rings` names
(a thread of the rank's process on CPU, a process on the rank's GPU there), and the checks are the
same for both buffer kinds:

- every worker read the ring of the rank on its own device, joined by it alone, both slots reused;
- what each engine's workers loaded, checksummed as vLLM's per-rank loader takes it
  (`checksum.VllmRankLayout`), adds up to the actor's weights exactly (`bridge.checksum`);
- "scheduled": the bytes each rank sends each other rank equal the schedule's, the trainer world
  carries nothing else (no gather), and all ranks together send each ring's worker exactly what it
  needs; with expert parallelism the ranks holding experts send them, whichever DP replica they are in.

    results = run_distributed(sync_rank, 2, model_dir, layouts, SharedMemoryTransport, start_reader)
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.bridge.checksum import LoadedChecksums, VllmRankLayout, check_checksums, combine, rank_checksums, recorded
from megarl.bridge.collect import sync_rank as sync_sender
from megarl.bridge.per_rank import PerRankSender
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.ring_routes import route_rings
from megarl.bridge.schedule import build_schedule
from megarl.bridge.scheduled_ring import ScheduledRingSender
from megarl.bridge.shared_ring import HOST, SharedRing, read_ring
from megarl.bridge.transports.shared_memory import SharedMemoryTransport
from megarl.config.memory import VOCAB_DIVISIBLE_BY
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model

WORLD = 2
TIMEOUT_S = 120
BUCKET_MB = 0.05
"""Small buckets: each ring streams several through its two slots."""
DTYPE = "float32"
"""The actor's and the rings' dtype (checksummed in it)."""
GATHERS = ("broadcast", "all_reduce", "all_gather", "gather", "all_gather_into_tensor", "send", "recv")

Train = tuple[int, int, int]
"""Train (TP, PP, EP); a mixture of experts' expert TP is 1."""
Layouts = Mapping[Train, tuple[tuple[int, bool], ...]]
"""Train (TP, PP, EP) → the (rollout TP, colocated) syncs from it; split: one engine."""
StartReader = Callable[[SharedRing, str, VllmRankLayout], object]
"""`(ring, worker's name, its layout)` → a handle whose `result(timeout)` returns `read_worker_ring`'s
dict once the worker has loaded the sync (e.g. a `concurrent.futures.Future`)."""


def layout_pair(train: Train, rollout_tp: int) -> LayoutPair:
    tp, pp, ep = train
    return LayoutPair(tp, pp, rollout_tp, train_ep=ep, train_etp=1 if ep > 1 else None)


def tiny_qwen3_moe(root) -> str:
    """The mixture of experts the EP layouts sync: a tiny Qwen3-MoE (8 experts, top-2)."""
    return str(make_tiny_model(root, "qwen3_moe"))


def tiny_qwen2(root) -> str:
    """The model both twins sync: a tiny Qwen2 with 2 KV heads (a qkv regroup at every TP)."""
    return str(
        make_tiny_model(
            root,
            "qwen2",
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    )


class TrainerWorld:
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


def read_worker_ring(ring: SharedRing, name: str, layout: VllmRankLayout, device: torch.device) -> dict:
    """An engine worker's load of one sync from `ring` onto `device`: the checksums of what it loaded
    (as vLLM's per-rank loader takes it) and this process's id."""
    record = LoadedChecksums(DTYPE)
    read_ring(ring, name, device, lambda tensors: [None for _ in recorded(tensors, record, layout)])
    return dict(record=record, reader_pid=os.getpid())


def sync_rank(
    model_dir: str, layouts: Layouts, transport: type[SharedMemoryTransport], start_reader: StartReader
) -> dict:
    """One trainer rank, in each train layout in turn (one spawn for all: megatron-core's grid torn
    down between them, as its own tests do), its rings of kind `transport`, read by the workers that
    `start_reader` starts on its device."""
    from megatron.core import parallel_state

    out = {}
    for train in layouts:
        out[train] = _layout(model_dir, train, layouts[train], transport, start_reader)
        parallel_state.destroy_model_parallel()
    return out


def _layout(
    model_dir: str,
    train: Train,
    syncs: tuple[tuple[int, bool], ...],
    transport: type[SharedMemoryTransport],
    start_reader: StartReader,
) -> dict:
    """One trainer rank and the engine worker on its device: for each rollout TP, open this rank's
    ring, learn every rank's (the driver's part), read the one the routes give this device's worker
    while sending; what was read, what was sent, and who joined this rank's ring."""
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import global_named_parameters

    tp, pp, ep = train
    groups = initialize_model_parallel(tp, pp, seed=0, ep=ep, etp=1 if ep > 1 else None)
    model = build_gpt_model(model_dir, groups)
    load_hf_weights(model, model_dir, groups)
    named = lambda: global_named_parameters(model, groups)  # noqa: E731
    dims = read_model_dims(model_dir)
    sender = sync_sender(layout_pair(train, 1), groups)  # the train side decides it: any rollout TP does
    grid = dict(
        rank=dist.get_rank(),
        tp_rank=groups.tp_rank,
        pp_rank=groups.pp_rank,
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        sync_sender=sender,
    )  # as `PolicyWorker.grid`
    grids = [None] * dist.get_world_size()
    dist.all_gather_object(grids, grid)
    rank = dist.get_rank()
    out = dict(sync_sender=sender)
    for rollout_tp, colocated in syncs:
        layout = layout_pair(train, rollout_tp)
        plan = build_plan(dims, layout, bucket_mb=BUCKET_MB)
        routes = route_rings(
            grids,
            engines=len(grids) // rollout_tp if colocated else 1,
            rollout_tp=rollout_tp,
            colocated=colocated,
            per_rank=True,
            experts_split=layout.experts_split,
        )
        readers = routes.readers[rank]
        ring_transport = transport(readers=readers, timeout_s=TIMEOUT_S) if readers else None
        if routes.per_rank:
            sender = PerRankSender(plan, named, groups, ring_transport)
        else:
            sender = ScheduledRingSender(plan, named, groups, routes, ring_transport)
        ring = sender.begin()
        rings = [None] * dist.get_world_size()
        dist.all_gather_object(rings, ring)
        # Colocated: the worker on this rank's bundle; split (one engine): worker `rank`, read here.
        engine, worker = divmod(rank, rollout_tp) if colocated else (0, rank)
        sync = out[rollout_tp, colocated] = dict(mode=routes.mode, engine=engine, readers=readers)
        with TrainerWorld() as world:
            if worker < rollout_tp:
                (mine,) = routes.engine_rings(engine, rings)[worker]
                read = start_reader(
                    mine, f"worker {worker} of engine {engine}", VllmRankLayout(dims, rollout_tp, worker)
                )
            stats = sender.send()
            if worker < rollout_tp:
                sync.update(read.result(timeout=TIMEOUT_S))
        sync.update(bytes=stats.bytes_sent, sent=dict(world.sent), other=world.other)
        if worker < rollout_tp:
            store = dist.TCPStore(HOST, ring.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
            sync.update(
                read_port=mine.port,
                own_port=ring.port,
                joined=store.add(ring.key("joined"), 0),
                joined_pid=int(store.get(ring.key("pid/0"))),
                buckets=stats.buckets,
            )
    out["checksums"] = rank_checksums(plan, named(), groups, DTYPE)
    return out


def check_rings_hosted_by_the_routed_ranks(ranks: list[dict], rollout_tp: int, colocated: bool, mode: str) -> None:
    """Every worker read the ring of the rank on its device (split: of rank r for worker r), joined by
    it alone, and both slots were reused; `ranks`: `sync_rank`'s results of one train layout."""
    for rank, out in enumerate(ranks):
        sync = out[rollout_tp, colocated]
        assert sync["mode"] == mode
        if not colocated and rank >= rollout_tp:
            assert sync["readers"] == 0  # split: the ranks past the engine's workers only send
            continue
        assert sync["read_port"] == sync["own_port"]  # the routes handed it this rank's ring ...
        assert (sync["joined"], sync["joined_pid"]) == (1, sync["reader_pid"])  # ... and nobody else joined it
        assert sync["buckets"] >= 3  # both slots reused


def check_workers_loaded_the_actors_weights(ranks: list[dict], train: Train, rollout_tp: int, colocated: bool) -> None:
    """Each engine's workers loaded the actor's weights bit for bit."""
    expected = combine(rank["checksums"] for rank in ranks)
    layout = layout_pair(train, rollout_tp)
    by_engine: dict[int, list] = {}
    for rank in ranks:  # in rank order: worker r of each engine
        sync = rank[rollout_tp, colocated]
        if "record" in sync:
            by_engine.setdefault(sync["engine"], []).append(sync["record"])
    assert len(by_engine) == (WORLD // rollout_tp if colocated else 1)
    for engine, records in by_engine.items():
        check_checksums(expected, records, dtype=DTYPE, layout=layout, engine=f"rollout engine {engine}")


def check_sent_as_scheduled(model_dir: str, ranks: list[dict], train: Train, rollout_tp: int, colocated: bool) -> None:
    """ "scheduled": each rank sent each other rank exactly the schedule's pieces for the worker
    reading that rank's ring, nothing else went through the trainer world, and all ranks together
    sent each ring's worker exactly what it needs."""
    layout = layout_pair(train, rollout_tp)
    schedule = build_schedule(build_plan(read_model_dims(model_dir), layout, bucket_mb=BUCKET_MB), VOCAB_DIVISIBLE_BY)
    rings = WORLD // rollout_tp if colocated else 1  # rings per worker: one per engine, split one for all
    itemsize = getattr(torch, DTYPE).itemsize
    total = 0
    for rank, out in enumerate(ranks):
        sync = out[rollout_tp, colocated]
        me = out["sync_sender"]
        scheduled = defaultdict(int)  # host rank -> bytes of the pieces for the worker reading its ring
        for _, piece in schedule.sent_by(me) if me is not None else ():
            for engine in range(rings):
                host = engine * rollout_tp + piece.worker
                if host != rank:  # a piece for this rank's own ring is copied, not sent
                    scheduled[host] += piece.numel * itemsize
        assert sync["other"] == []  # no gather, no broadcast: the pieces alone
        assert sync["sent"] == dict(scheduled)
        assert sync["bytes"] == (0 if me is None else schedule.bytes_sent(me, rings))
        assert sync["bytes"] > 0 or me is None
        total += sync["bytes"]
        print(
            f"{layout} ({'colocated' if colocated else 'split'}): "
            f"rank {rank} sent {sum(sync['sent'].values())} B to other ranks, {sync['bytes']} B scheduled in all"
        )
    # All ranks together send each ring's workers exactly what they need, each element once.
    assert total == rings * sum(schedule.bytes_needed(worker) for worker in range(rollout_tp))
