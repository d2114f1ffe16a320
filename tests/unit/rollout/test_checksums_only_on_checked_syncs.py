"""Checksums only on checked syncs (`rollout.sync.verify_every`): an unchecked sync computes no
checksum anywhere, on the engines or on the trainer ranks; a checked one checksums every tensor once
on each side, and the exact check passes on those checksums.

The chain is the real one from the driver to the vLLM worker: `HandOver` and `WeightSync` → `RolloutWorker` →
`VLLMRolloutEngine` → `LLM.collective_rpc` → `WeightSyncWorkerExtension`. `InProcessLLM` stands in
for `vllm.LLM` with TP 1, whose uniprocess executor runs a collective RPC as the worker's method of
that name, in-process, with the arguments as they are (vllm/v1/executor/uniproc_executor.py
`collective_rpc` → `run_method(self.driver_worker, ...)`). The vLLM worker is the extension over a
model of named tensors whose `reload_weights` takes them as vLLM's does (`weights_iterator=`,
`is_checkpoint_format=`: vllm/v1/worker/gpu_model_runner.py `reload_weights`). The sync group's
transport stands aside: the worker receives the plan's tensors through the extension's `_load`.
Checksums are counted at `bridge.checksum.block_checksum`, which every checksum of either side ends in.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from recorded_transfers import RecordingWorkers

from megarl.bridge import checksum
from megarl.cluster.handover import HandOver
from megarl.cluster.sync_step import WeightSync
from megarl.cluster.timing import PhaseTimer
from megarl.config.loader import load_config
from megarl.workers.rollout import vllm_engine
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.rollout.rollout_worker import RolloutWorker
from megarl.workers.rollout.worker_extension import WeightSyncWorkerExtension

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
TENSORS = {
    "model.embed_tokens.weight": torch.randn(16, 8),
    "model.norm.weight": torch.randn(8),
    "lm_head.weight": torch.randn(16, 8),
}
"""The actor's weights, which every sync sends (the quickstart trains in float32, its engines' dtype)."""


def probe_log_prob(token: int) -> float:
    """The log-prob both sides give `token` in the sync's probe: the engines hold the actor's weights."""
    return -(token % 7 + 1) / 10


class FakeVllmWorker(WeightSyncWorkerExtension):
    """A vLLM worker's surface that the extension uses, over a model of named float32 tensors."""

    def __init__(self):
        self.model_config = SimpleNamespace(
            dtype=torch.float32, hf_text_config=SimpleNamespace(tie_word_embeddings=False)
        )
        self.weights: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        self.weights.update((name, tensor.clone()) for name, tensor in weights_iterator)

    def get_model(self) -> torch.nn.Module:
        """vLLM's `Worker.get_model`: the model, here one without fused-MoE layers to redo after a load."""
        return torch.nn.Module()

    def receive_weights(self, plan) -> None:
        self._load(iter(plan))  # the plan here is the sync's tensors: the transport is not under test


class InProcessLLM:
    """`vllm.LLM` with TP 1: a collective RPC is the one worker's method, run here."""

    def __init__(self, **kwargs):
        self.worker = FakeVllmWorker()

    def collective_rpc(self, method, args=(), kwargs=None):
        if method in ("shm_names", "rank_tokens_eagerly"):  # engine start-up: CPU segments, sampler warm-up
            return [[]]
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, requests, params, use_tqdm):  # the sync's probe: the actor's own log-probs
        return [
            SimpleNamespace(
                prompt_logprobs=[None]
                + [{token: SimpleNamespace(logprob=probe_log_prob(token))} for token in r["prompt_token_ids"][1:]]
            )
            for r in requests
        ]


def hosted(target) -> RecordingWorkers:
    """A worker group of one rank, hosting `target` as `megarl.orchestration` would."""
    group = RecordingWorkers(1, ())
    group.ranks = [target]
    return group


class Actor:
    """The policy group's side of the sync: its checksums are the real ones of the weights it sends."""

    def sync_plan(self):
        return list(TENSORS.items())

    def send_weights(self):
        return {"sync/seconds": 0.01}

    def weight_checksums(self, dtype: str) -> dict[str, int]:
        return {name: checksum.tensor_checksum(tensor, getattr(torch, dtype)) for name, tensor in TENSORS.items()}

    def probe_log_probs(self, token_ids):
        return torch.tensor([[probe_log_prob(token) for token in ids[1:]] for ids in token_ids])

    def memory_stats(self) -> dict[str, float]:
        return {}

    offload_training_state = offload_params = memory_stats


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """The number of tensors checksummed so far (one entry per `block_checksum` call)."""
    calls: list[int] = []
    block_checksum = checksum.block_checksum

    def counting(*args, **kwargs):
        calls.append(1)
        return block_checksum(*args, **kwargs)

    monkeypatch.setattr(checksum, "block_checksum", counting)
    return calls


@pytest.fixture
def sync(monkeypatch) -> HandOver:
    """The hand-over of engines that do not sleep, driving the run's `WeightSync` (`sync`)."""
    monkeypatch.setattr(vllm_engine, "LLM", InProcessLLM)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):  # the engine sets them on CPU: undone after
        monkeypatch.setenv(name, "")
    rollout = RolloutWorker(
        "vllm",
        EngineArgs(
            "/no/model",
            dtype="float32",
            max_model_len=64,
            enforce_eager=True,
            sleep_level=2,
        ),
    )
    config = load_config(QUICKSTART, ["rollout.sync.verify_every=3"])
    policy = hosted(Actor())
    groups = {"actor": SimpleNamespace(workers=policy)}
    roles = SimpleNamespace(groups=groups, policy=policy, rollout=hosted(rollout), routes=None)
    weight_sync = WeightSync(roles, config, vocab_size=64, total_steps=4)
    yield HandOver(roles, weight_sync, engines_sleep=False, timer=PhaseTimer())
    rollout.engine._rpc_thread.shutdown(wait=True)


def test_unchecked_syncs_checksum_nothing_checked_ones_every_tensor_on_each_side(sync, counted):
    checksummed, checked = {}, []
    for step in range(1, 5):  # checked: 1 (the first), 3 (a multiple of 3), 4 (the last)
        before = len(counted)
        metrics = sync.to_rollout(step)
        checksummed[step] = len(counted) - before
        if "sync/checksum_tensors" in metrics:
            assert metrics["sync/checksum_tensors"] == len(TENSORS)
            checked.append(step)
    assert checked == [1, 3, 4]
    assert sync.rollout.ranks[0].engine.weight_version == 4  # every sync loaded
    assert checksummed == {1: 2 * len(TENSORS), 2: 0, 3: 2 * len(TENSORS), 4: 2 * len(TENSORS)}


def test_an_unchecked_load_leaves_no_checksums_to_be_taken_for_its_own(sync):
    sync.to_rollout(1)
    sync.to_rollout(2)  # unchecked: the engines' records of step 1 are forgotten
    with pytest.raises(RuntimeError, match=r"checksum_loads\(False\)"):
        sync.rollout.call_all("loaded_checksums")
