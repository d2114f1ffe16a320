"""The shared-memory transport end to end: a Megatron actor at train TP 2 (two spawned ranks) syncs
into a rollout-TP-2 vLLM engine (two worker processes) on the same node. Rank 0 streams the buckets
through its two /dev/shm slots and passes only the ring's handle to the engine's driver (this
process, through a TCP store, as a Ray call would in a deployment), which starts the engine's one
load; both vLLM workers map the same slots and load from them. Twice, with optimizer steps before
each sync: both engine workers loaded every tensor bit for bit as the actor's shards hold it (the
exact check), the engine's prompt log-probs equal the actor's to 1e-4 after each, they moved in
between, the slots never held more than two of the sync's largest bucket, and they are gone after."""

from __future__ import annotations

import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from store_handoff import load_paused, take

from megarl.bridge import SharedRings
from megarl.bridge.checksum import check_checksums, combine, rank_checksums
from megarl.bridge.plan import LayoutPair
from megarl.bridge.shared_ring import SLOTS
from megarl.bridge.sync import WeightSender
from megarl.bridge.transports import SharedMemoryTransport
from megarl.bridge.verify import check_sync, probe_token_ids
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed
from megarl.workers.rollout import make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.sync_check import TrainSettings, train_a_little, trained_actor_and_plan
from megarl.workers.sync_probe import actor_probe_logprobs

HOST = "127.0.0.1"
THRESHOLD = 1e-4
ROUNDS = 2
TIMEOUT_S = 300
LAYOUT = LayoutPair(train_tp=2, train_pp=1, rollout_tp=2)


def _trainer(model_dir: str, store_port: int) -> list[dict] | None:
    """One training rank: per round, train, record the probe log-probs, sync, checksum its shards.
    Rank 0 hands each sync's ring over through the store; its send returns once the engine's workers
    have loaded it."""
    groups, actor, dims, plan = trained_actor_and_plan(model_dir, LAYOUT, 0.05, TrainSettings())
    results: list[dict] = []
    transport = None
    slot_paths: list[list[str]] = []
    if dist.get_rank() == 0:
        store = dist.TCPStore(HOST, store_port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))

        transport = SharedMemoryTransport(readers=LAYOUT.rollout_tp, timeout_s=TIMEOUT_S)
    sender = WeightSender(plan, actor.named_parameters_for_sync, groups, transport)
    probe = probe_token_ids(dims.vocab_size)
    for round_index in range(ROUNDS):
        train_a_little(actor, dims.vocab_size, TrainSettings(), round_index)
        logprobs = actor_probe_logprobs(actor, probe)
        if transport is not None:  # the engine starts loading from the sync's ring, then the ranks send
            store.set(f"round{round_index}", pickle.dumps(transport.begin()))
            slot_paths.append(list(transport.slot_paths))
        stats = sender.send()
        results.append(
            dict(
                actor=logprobs.tolist(),
                buckets=stats.buckets,
                suspects=sender.conversion_errors(),
                checksums=rank_checksums(plan, actor.named_parameters_for_sync(), groups, "float32"),
            )
        )
        if transport is not None:
            results[-1].update(
                bytes_sent=stats.bytes_sent,
                peak_shared_bytes=transport.peak_shared_bytes,
                largest_bucket_bytes=transport.largest_bucket_bytes,
                slot_paths=slot_paths[-1],
            )
    return results


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("shm_sync"), "qwen2", initializer_range=0.2)


def test_train_tp2_syncs_into_rollout_tp2_through_shared_memory(model_dir):
    probe = probe_token_ids(100)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    engine_logprobs, loaded = [], []
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The ranks load and train while the engine starts; the first sync waits for the engine.
        trainers = pool.submit(run_distributed, _trainer, 2, str(model_dir), store.port, timeout_s=TIMEOUT_S)
        engine = make_rollout_engine(
            "vllm", EngineArgs(model_dir, tensor_parallel_size=2, dtype="float32", max_model_len=64)
        )
        try:
            for round_index in range(ROUNDS):
                ring = pickle.loads(take(store, f"round{round_index}", trainers))
                engine_logprobs.append(
                    load_paused(engine, lambda: engine.receive(SharedRings({0: ring, 1: ring})), probe, TIMEOUT_S)
                )
                loaded.append(engine.loaded_checksums())
            per_rank = trainers.result(timeout=TIMEOUT_S)
            rounds = per_rank[0]
            assert engine.weight_version == ROUNDS
        finally:
            engine.shutdown()
    for index, (trained, after) in enumerate(zip(rounds, engine_logprobs)):
        assert trained["buckets"] > 2 * SLOTS  # the slots were reused within the one load
        expected = combine(rank_rounds[index]["checksums"] for rank_rounds in per_rank)
        assert len(loaded[index]) == LAYOUT.rollout_tp and all(set(w.full) == set(expected) for w in loaded[index])
        check_checksums(expected, loaded[index], dtype="float32", layout=LAYOUT, engine="the engine")
        metrics = check_sync(
            list(after),
            torch.tensor(trained["actor"]),
            threshold=THRESHOLD,
            layout=LAYOUT,
            suspects=trained["suspects"],
        )
        assert metrics["sync/logprob_max_abs_diff"] <= THRESHOLD
        # The sync's footprint in /dev/shm: two slots, each at most the largest bucket, not the model.
        assert trained["peak_shared_bytes"] <= SLOTS * trained["largest_bucket_bytes"] < trained["bytes_sent"]
        assert len(trained["slot_paths"]) == SLOTS
        assert not any(os.path.exists(path) for path in trained["slot_paths"])
    assert (engine_logprobs[1] - engine_logprobs[0]).abs().max() > 100 * THRESHOLD
