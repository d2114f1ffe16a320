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
- a mixture of experts at EP 2 (TP 1, two DP replicas of the dense weights): "scheduled" at every rollout
  TP, equal TP included (a rank's own shards hold half the experts, no worker's), rank 0 sending the dense
  weights and its experts, rank 1 only its experts, colocated and split.

No vLLM here (the engines' side of the rings runs in the e2e trainer tests): a tiny Qwen2 (and a tiny
Qwen3-MoE) loaded into Megatron, no training, small buckets so each ring cycles through both slots. The driving and the
checks are `device_rings`', shared with the CUDA IPC twin (tests/gpu/test_scheduled_ring_cuda.py)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from device_rings import (
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

from megarl.bridge.checksum import VllmRankLayout
from megarl.bridge.shared_ring import SharedRing
from megarl.bridge.transports.shared_memory import SharedMemoryTransport
from megarl.parallel.spawn import run_distributed

LAYOUTS = {(2, 1, 1): ((2, True), (1, True), (1, False)), (1, 2, 1): ((1, True), (2, True))}
"""Train (TP, PP, EP) → the (rollout TP, colocated) syncs from it; split: one engine."""
MOE_LAYOUTS = {(1, 1, 2): ((1, True), (2, True), (1, False))}
"""The same for the mixture of experts."""


def _start_thread_reader(ring: SharedRing, name: str, layout: VllmRankLayout) -> Future:
    """The engine worker on this rank's device: a thread of the rank's process, reading the ring onto
    the CPU."""
    executor = ThreadPoolExecutor(max_workers=1)
    read = executor.submit(read_worker_ring, ring, name, layout, torch.device("cpu"))
    executor.shutdown(wait=False)  # the thread ends with its read
    return read


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen2(tmp_path_factory.mktemp("rings"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_qwen3_moe(tmp_path_factory.mktemp("moe_rings"))


@pytest.fixture(scope="module")
def worlds(model_dir, moe_dir):
    out = {}
    for model, layouts in ((model_dir, LAYOUTS), (moe_dir, MOE_LAYOUTS)):
        ranks = run_distributed(
            sync_rank, WORLD, model, layouts, SharedMemoryTransport, _start_thread_reader, timeout_s=TIMEOUT_S * 2
        )
        out |= {layout: [rank[layout] for rank in ranks] for layout in layouts}
    return out


CASES = [
    ((2, 1, 1), 2, True, "per_rank"),
    ((2, 1, 1), 1, True, "scheduled"),
    ((1, 2, 1), 1, True, "scheduled"),
    ((1, 2, 1), 2, True, "scheduled"),
    ((2, 1, 1), 1, False, "scheduled"),
    ((1, 1, 2), 1, True, "scheduled"),
    ((1, 1, 2), 2, True, "scheduled"),
    ((1, 1, 2), 1, False, "scheduled"),
]


@pytest.mark.parametrize("train, rollout_tp, colocated, mode", CASES)
def test_each_workers_ring_is_hosted_by_the_rank_the_routes_name(worlds, train, rollout_tp, colocated, mode):
    check_rings_hosted_by_the_routed_ranks(worlds[train], rollout_tp, colocated, mode)


@pytest.mark.parametrize("train, rollout_tp, colocated, mode", CASES)
def test_the_workers_loaded_the_actors_weights_bit_for_bit(worlds, train, rollout_tp, colocated, mode):
    check_workers_loaded_the_actors_weights(worlds[train], train, rollout_tp, colocated)


@pytest.mark.parametrize(
    "train, rollout_tp, colocated",
    [(train, tp, colocated) for train, tp, colocated, mode in CASES if mode == "scheduled"],
)
def test_each_rank_sends_only_the_schedules_pieces_for_each_rings_worker(
    model_dir, moe_dir, worlds, train, rollout_tp, colocated
):
    check_sent_as_scheduled(moe_dir if train in MOE_LAYOUTS else model_dir, worlds[train], train, rollout_tp, colocated)
