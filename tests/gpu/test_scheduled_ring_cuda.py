"""The scheduled ring sync on two GPUs (issue 15, items 2 and 5): two trainer ranks, one per GPU, in
one NCCL world; train (TP, PP) = (2, 1) and (1, 2) → rollout TP 1 (an engine per GPU) and (1, 2) →
rollout TP 2 (one engine over both GPUs), and a tiny Qwen3-MoE at EP 2 → rollout TP 1 and 2 (issue 29:
experts split over the trainer's ranks, each sent by the rank holding it), all colocated, so mode "scheduled"
(`megarl.bridge.ring_routes`): each rank sends only its scheduled pieces point to point inside the
trainer world (`ScheduledRingSender`: `torch.distributed.batch_isend_irecv`, which with NCCL runs the
sends and receives of a bucket as one coalesced group, `distributed_c10d.batch_isend_irecv`'s
`_coalescing_manager` branch, on the device each rank set with `torch.cuda.set_device`), and each rank
assembles the tensors of the worker on its GPU in vLLM's per-rank layout and streams them through its
own CUDA IPC ring (`CudaIpcTransport`: `torch.multiprocessing.reductions.reduce_tensor` shares each
slot, the reader opens it with `rebuild_cuda_tensor`, its `storage_device` set to the reader's own
index of the slot's GPU, found by device UUID).

Each GPU's engine worker is a process of its own that sees only that GPU (as Ray narrows a worker's
`CUDA_VISIBLE_DEVICES`), so it opens every handle as cuda:0 while rank 1's buffers are cuda:1 in the
sender: the UUID keying does the mapping. The checks are the CPU twin's
(tests/distributed/bridge/test_per_device_rings.py, shared memory, through `device_rings`): each
worker read the ring of the rank on its own GPU, and no other process joined it; what each engine
loaded, checksummed as vLLM's per-rank loader takes it, equals the actor's weights bit for bit; the
bytes each rank sent each other rank equal the schedule's, and nothing else crossed the trainer world.
Needs 2 GPUs (NCCL refuses two ranks of one world on one GPU)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import traceback

import pytest
import torch

from megarl.bridge.checksum import VllmRankLayout
from megarl.bridge.shared_ring import SharedRing
from megarl.bridge.transports.cuda_ipc import CudaIpcTransport, device_uuid
from megarl.parallel.spawn import run_distributed
from tests.distributed.bridge.device_rings import (
    TIMEOUT_S,
    WORLD,
    check_rings_hosted_by_the_routed_ranks,
    check_sent_as_scheduled,
    check_workers_loaded_the_actors_weights,
    read_worker_ring,
    sync_rank,
    tiny_qwen2,
    tiny_qwen3_moe,
)

pytestmark = pytest.mark.gpu

LAYOUTS = {(2, 1, 1): ((1, True),), (1, 2, 1): ((1, True), (2, True))}
"""Train (TP, PP, EP) → the (rollout TP, colocated) syncs from it: the colocated scheduled ones (a split
engine is on other GPUs than the trainer's, where CUDA IPC does not reach)."""
MOE_LAYOUTS = {(1, 1, 2): ((1, True), (2, True))}
"""The same for the mixture of experts."""
CASES = [((2, 1, 1), 1), ((1, 2, 1), 1), ((1, 2, 1), 2), ((1, 1, 2), 1), ((1, 1, 2), 2)]
"""(train (TP, PP, EP), rollout TP), colocated."""


def _read_on_its_gpu(ring: SharedRing, name: str, layout: VllmRankLayout, results) -> None:
    """The engine worker on the rank's GPU, its only visible one: what it loaded and which GPU that is."""
    try:
        torch.cuda.set_device(0)
        results.put(dict(read_worker_ring(ring, name, layout, torch.device("cuda", 0)), reader_gpu=device_uuid(0)))
    except BaseException:
        results.put(dict(error=traceback.format_exc()))


@contextlib.contextmanager
def _children_see_only(index: int):
    """Processes started meanwhile see only this process's GPU `index`, as their cuda:0 (its id in
    this process's CUDA_VISIBLE_DEVICES, else the index itself, as Ray sets it)."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [gpu.strip() for gpu in before.split(",")] if before else None
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index] if ids else str(index)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class _GpuReader:
    """`device_rings.StartReader` on GPU: a process on this rank's GPU reading `ring`."""

    def __init__(self, ring: SharedRing, name: str, layout: VllmRankLayout):
        index = torch.cuda.current_device()
        self.own_gpu = device_uuid(index)
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.process = context.Process(target=_read_on_its_gpu, args=(ring, name, layout, self.results), daemon=True)
        with _children_see_only(index):
            self.process.start()

    def result(self, timeout: float) -> dict:
        got = self.results.get(timeout=timeout)
        self.process.join(timeout)
        if "error" in got:
            raise RuntimeError(f"the engine worker reading this rank's CUDA IPC ring failed:\n{got['error']}")
        return dict(got, own_gpu=self.own_gpu, reader_exitcode=self.process.exitcode)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen2(tmp_path_factory.mktemp("rings"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_qwen3_moe(tmp_path_factory.mktemp("moe_rings"))


@pytest.fixture(scope="module")
def worlds(model_dir, moe_dir):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(
            f"the scheduled CUDA IPC rings need {WORLD} GPUs (one trainer rank each), "
            f"{torch.cuda.device_count()} visible"
        )
    out = {}
    for model, layouts in ((model_dir, LAYOUTS), (moe_dir, MOE_LAYOUTS)):
        ranks = run_distributed(sync_rank, WORLD, model, layouts, CudaIpcTransport, _GpuReader, timeout_s=TIMEOUT_S * 2)
        out |= {layout: [rank[layout] for rank in ranks] for layout in layouts}
    return out


@pytest.mark.parametrize("train, rollout_tp", CASES)
def test_each_gpus_worker_reads_its_own_ranks_ring_by_uuid(worlds, train, rollout_tp):
    ranks = worlds[train]
    check_rings_hosted_by_the_routed_ranks(ranks, rollout_tp, True, "scheduled")
    syncs = [rank[rollout_tp, True] for rank in ranks]
    assert all(sync["reader_exitcode"] == 0 for sync in syncs)
    assert [sync["reader_gpu"] for sync in syncs] == [sync["own_gpu"] for sync in syncs]
    assert len({sync["own_gpu"] for sync in syncs}) == WORLD  # one rank per GPU: NCCL never sees a GPU twice


@pytest.mark.parametrize("train, rollout_tp", CASES)
def test_the_workers_loaded_the_actors_weights_bit_for_bit(worlds, train, rollout_tp):
    check_workers_loaded_the_actors_weights(worlds[train], train, rollout_tp, True)


@pytest.mark.parametrize("train, rollout_tp", CASES)
def test_each_rank_sends_only_the_schedules_pieces_over_nccl(model_dir, moe_dir, worlds, train, rollout_tp):
    check_sent_as_scheduled(moe_dir if train in MOE_LAYOUTS else model_dir, worlds[train], train, rollout_tp, True)
