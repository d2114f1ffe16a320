"""The loop's cluster, in process: `Trainer.fit` runs its real loop (rollout phase, reward workers, staging,
advantages, checkpoints, resume, metrics, stop conditions) against fake worker groups, in seconds.

    with fake_cluster(monkeypatch) as cluster:      # patches the trainer's cluster seam, `start_cluster`
        trainer = Trainer.from_config(QUICKSTART, overrides)
        trainer.fit()

The loop drives the run's own `megarl.cluster.running.RunningCluster` (the `Cluster` protocol); what is fake
is what `megarl.cluster.roles.start_roles` starts and what drives it across processes: the
Megatron group is `FakePolicyWorker` ranks and the engines `FakeEngine`s, called through
`recorded_transfers.RecordingWorkers` (each rank gets its own pickled copy of the arguments, as a Ray
actor does; every call to a group counts as the driver round trip it is, `perf/round_trips`). The
hand-over and the weight sync are the run's own (`HandOver`, `WeightSync`): the engines sleep and wake,
and a receive takes the weights of policy rank 0, as the collective transport's does; checked syncs
compare the engines' checksums and probe log-probs with the actor's. The model is a bag of tokens: one logit per vocabulary entry,
shared by every position, trained by a policy gradient with momentum (an optimizer state that a resume
must restore to continue exactly). Each fake's methods have the names and parameters of the real class
they stand for (`test_loop_on_fake_cluster.py::test_the_fakes_keep_the_real_signatures`).

Checkpoints are real ones: `megarl.workers.checkpoint_files` writes them (temp dir, SHA-256 manifest,
atomic rename), so `CheckpointManager` lists, rotates, verifies and resumes them as it does a job's.
"""

from __future__ import annotations

import json
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from recorded_transfers import RecordingWorkers, grids

import megarl.trainer.trainer as trainer_module
from megarl.bridge.checksum import LoadedChecksums
from megarl.cluster.roles import MegatronGroup, Roles
from megarl.cluster.running import RunningCluster
from megarl.models.hf_config import read_model_dims
from megarl.workers.checkpoint_files import (
    build_manifest,
    commit,
    new_nonce,
    step_dir_name,
    tmp_dir_for,
)
from megarl.workers.policy_worker import PolicyWorker
from megarl.workers.profiling import StepProfiler
from megarl.workers.rollout.base import RolloutOutput, SamplingConfig, prompt_seeds

LEARNING_RATE = 20.0
MOMENTUM = 0.9
WEIGHTS_FILE = "actor/weights.pt"
WEIGHTS_NAME = "lm_head.weight"
"""The one tensor the fake model has, by the HF name its checksums carry."""
EXTRA_FILE = "extra.json"


class FakePolicyWorker:
    """A policy rank (`PolicyWorker`): its staging methods are `PolicyWorker`'s own; the actor is a
    `[V]` float64 logit vector."""

    stage_batch = PolicyWorker.stage_batch
    call_staged = PolicyWorker.call_staged
    staged_field = PolicyWorker.staged_field
    drop_staged = PolicyWorker.drop_staged
    stop_profile = PolicyWorker.stop_profile

    def __init__(self, rank: int, vocab_size: int, cluster: FakeCluster):
        self.rank = rank
        self.staged = None
        self.profiler = StepProfiler("actor", rank=rank, cuda=False)
        self.weights = torch.zeros(vocab_size, dtype=torch.float64)
        self.momentum = torch.zeros(vocab_size, dtype=torch.float64)
        self.cluster = cluster

    def compute_log_prob(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, R]` log-probs of the responses and the policy's entropy at each position."""
        log_probs = torch.log_softmax(self.weights, dim=0)
        entropy = -(log_probs.exp() * log_probs).sum()
        return log_probs[batch.responses].float(), torch.full(batch.responses.shape, float(entropy))

    def update_actor(self, batch, shuffle_seed: int) -> dict[str, float]:
        """One policy-gradient step; a non-finite gradient (or a step the cluster marks bad) is skipped,
        weights and momentum unchanged, as megatron-core's optimizer skips it."""
        mask = batch.response_mask.to(torch.float64)
        advantages = batch.advantages.to(torch.float64) * mask
        log_probs = torch.log_softmax(self.weights, dim=0)
        probs = log_probs.exp()
        tokens = mask.sum()
        # d/dw of mean over tokens of A * log p(token): A * (onehot(token) - p).
        counts = torch.zeros_like(self.weights).index_add_(0, batch.responses.flatten(), advantages.flatten())
        gradient = (counts - advantages.sum() * probs) / tokens
        pg_loss = float(-(advantages * log_probs[batch.responses]).sum() / tokens)
        grad_norm = float(gradient.norm())
        skipped = not torch.isfinite(gradient).all() or shuffle_seed in self.cluster.bad_steps
        if not skipped:
            self.momentum = MOMENTUM * self.momentum + gradient
            self.weights = self.weights + LEARNING_RATE * self.momentum
        entropy = float(-(probs * log_probs).sum())
        return {
            "loss": pg_loss,
            "pg_loss": pg_loss,
            "grad_norm": grad_norm,
            "entropy": entropy,
            "tokens": float(tokens),
            "steps": 1.0,
            "skipped_steps": float(skipped),
        }

    def matmul_peak(self) -> float:
        return 1e12

    def memory_stats(self) -> dict[str, float]:
        return {"rss_gib": 0.0}

    onload = offload_training_state = offload_params = memory_stats

    def sync_plan(self) -> str:
        return "the fake plan"

    def send_weights(self) -> dict[str, float]:
        return {"sync/buckets": float(self.rank == 0)}

    def weight_checksums(self, dtype: str) -> dict[str, int]:
        """Rank 0's checksum of the weights (the others hold the same; `combine` sums the ranks')."""
        return {WEIGHTS_NAME: weights_checksum(self.weights)} if self.rank == 0 else {}

    def probe_log_probs(self, token_ids: list[list[int]]) -> torch.Tensor:
        """`[B, T-1]` log-probs of each probe sequence's tokens after the first."""
        return torch.stack(probe_log_probs(self.weights, token_ids))

    def save_checkpoint(self, root: str, step: int, extra: dict) -> str:
        """Rank 0 writes `<root>/step_<step>` as the real save does: a temp dir, the SHA-256 manifest
        (`build_manifest`), then the atomic rename (`commit`); the other ranks hold the same state."""
        step_dir = Path(root) / step_dir_name(step)
        if self.rank == 0:
            tmp_dir = tmp_dir_for(step_dir, new_nonce())
            (tmp_dir / "actor").mkdir(parents=True)
            torch.save({"weights": self.weights, "momentum": self.momentum}, tmp_dir / WEIGHTS_FILE)
            (tmp_dir / EXTRA_FILE).write_text(json.dumps(extra))
            layout = {"world_size": self.cluster.world_size, "tp": self.cluster.world_size, "pp": 1, "dp": 1}
            commit(tmp_dir, step_dir, build_manifest(tmp_dir, step=step, roles=["actor"], layout=layout))
        self.cluster.saved.append(step)
        return str(step_dir)

    def load_checkpoint(self, path: str) -> dict:
        state = torch.load(Path(path) / WEIGHTS_FILE, weights_only=True)
        self.weights, self.momentum = state["weights"], state["momentum"]
        return json.loads((Path(path) / EXTRA_FILE).read_text())

    def export_hf(self, root: str) -> str | None:
        raise NotImplementedError("the fake cluster has no HF model to export: run with checkpoint.export_hf=false")


def weights_checksum(weights: torch.Tensor) -> int:
    return zlib.crc32(weights.numpy().tobytes())


def probe_log_probs(weights: torch.Tensor, token_ids: list[list[int]]) -> list[torch.Tensor]:
    log_probs = torch.log_softmax(weights, dim=0)
    return [log_probs[torch.tensor(tokens[1:]) % len(weights)].float() for tokens in token_ids]


class FakeEngine:
    """A rollout engine (`RolloutWorker`): samples from the logits it was last synced; asleep, it refuses
    to generate (a real engine would never answer)."""

    def __init__(self, vocab_size: int, cluster: FakeCluster):
        self.weights = torch.zeros(vocab_size, dtype=torch.float64)
        self.weight_version = 0
        self.cluster = cluster
        self.awake = {"weights", "kv_cache"}
        self.checksumming = True

    def memory_stats(self) -> dict[str, float]:
        return {"rss_gib": 0.0}

    def sleep(self) -> dict[str, float]:
        self.awake = set()
        return self.memory_stats()

    def wake_up(self, tags: list[str] | None = None) -> dict[str, float]:
        self.awake |= set(tags or ("weights", "kv_cache"))
        return self.memory_stats()

    def checksum_loads(self, enabled: bool) -> None:
        self.checksumming = enabled

    def start_receive(self, source) -> None:
        assert "weights" in self.awake, "a receive into weights that are asleep"

    def finish_receive(self, timeout_s: float) -> int:
        """The load: policy rank 0's weights (its trained ones, as the send that runs beside it sends them)."""
        self.weights = self.cluster.roles.policy.ranks[0].weights.clone()
        self.weight_version += 1
        return self.weight_version

    def loaded_checksums(self) -> list[LoadedChecksums]:
        full = {WEIGHTS_NAME: weights_checksum(self.weights)} if self.checksumming else {}
        return [LoadedChecksums("float32", full=full)]

    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        return [log_probs + self.cluster.probe_gap for log_probs in probe_log_probs(self.weights, token_ids)]

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        max_new_tokens: list[int] | None = None,
        seeds: list[int] | None = None,
    ) -> list[RolloutOutput]:
        """`sampling.n` samples per prompt, sample j of prompt i drawn with seed `prompt_seeds[i] + j`
        (as the real engines seed them), so a sample depends on its seed and the weights only."""
        assert self.awake == {"weights", "kv_cache"}, "generate on an engine that is not awake"
        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompt_token_ids)
        logits = self.weights / (1.0 if sampling.greedy else sampling.temperature)
        log_probs = torch.log_softmax(logits, dim=0)
        outputs = []
        for prompt, seed, cap in zip(prompt_token_ids, prompt_seeds(sampling, len(prompt_token_ids), seeds), caps):
            out = RolloutOutput(list(prompt))
            for j in range(sampling.n):
                generator = torch.Generator().manual_seed(0 if seed is None else seed + j)
                tokens, reason = [], "length"
                for _ in range(cap):
                    token = int(
                        log_probs.argmax()
                        if sampling.greedy
                        else torch.multinomial(log_probs.exp(), 1, generator=generator)
                    )
                    tokens.append(token)
                    if token in sampling.stop_token_ids:
                        reason = "stop"
                        break
                out.response_token_ids.append(tokens)
                out.response_logprobs.append(log_probs[tokens].float())
                out.finish_reasons.append(reason)
            outputs.append(out)
        return outputs


class FakeRoles(Roles):
    """The real `Roles` (staging, checkpoint save and load) over fake groups; nothing to stop."""

    def shutdown(self) -> None:
        self.rollout.shut_down = True


@dataclass
class FakeCluster:
    """What `start_cluster` started, for the test to look at."""

    bad_steps: set[int] = field(default_factory=set)
    """Steps whose update the fake actor reports skipped (`actor/skipped_steps`), as a NaN gradient would."""
    probe_gap: float = 0.0
    """Added to the engines' log-probs of the sync check's probes, as engines whose numerics differ from
    the actor's would (the exact checksums still agree)."""
    world_size: int = 0
    saved: list[int] = field(default_factory=list)
    """Steps saved, in order, once per rank."""
    roles: FakeRoles | None = None

    def start_cluster(self, config, plan, total_steps, env, startup, *, timer, vocab_size) -> RunningCluster:
        """`megarl.cluster.running.start_cluster`: the run's `RunningCluster` over fake groups."""
        if plan.critic is not None or plan.ref is not None:
            raise NotImplementedError("the fake cluster hosts an actor only (no critic, no reference)")
        vocab = read_model_dims(config.model.path).vocab_size
        layout = grids(plan.actor.tensor_parallel, plan.actor.pipeline_parallel, plan.actor.data_parallel)
        self.world_size = len(layout)
        policy = RecordingWorkers(len(layout), (), "actor")
        policy.ranks = [FakePolicyWorker(rank, vocab, self) for rank in range(len(layout))]
        engines = RecordingWorkers(plan.rollout_engines, (), "rollout")
        engines.ranks = [FakeEngine(vocab, self) for _ in range(engines.world_size)]
        engines.shut_down = False
        with startup("megatron"):
            self.roles = FakeRoles(
                {"actor": MegatronGroup(policy, layout)},
                rollout=engines,
                placement=None,
                sync_transport="fake",
                routes=None,
            )
        return RunningCluster.over(self.roles, config, timer=timer, vocab_size=vocab_size, total_steps=total_steps)


@contextmanager
def fake_cluster(monkeypatch, bad_steps=(), probe_gap=0.0):
    """Point `Trainer.fit` at a `FakeCluster` (no Ray, no Megatron, no vLLM): the trainer's seam is the
    names `megarl.trainer.trainer` imports to start the cluster (`start_cluster`) and Ray."""
    cluster = FakeCluster(set(bad_steps), probe_gap)
    monkeypatch.setattr(trainer_module, "init_ray", lambda **_: None)
    monkeypatch.setattr(trainer_module, "shutdown_ray", lambda: None)
    monkeypatch.setattr(trainer_module, "start_cluster", cluster.start_cluster)
    yield cluster
