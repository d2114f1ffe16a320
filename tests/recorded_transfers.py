"""The trainer's step against Megatron groups of recording stand-ins: what crosses the Ray boundary.

`RecordingWorkers` stands in for `megarl.orchestration.worker_group.WorkerGroup` as the trainer uses it
(`submit` and the calls made of it: `call_each`, `call_all`, `call_rank0`, `chain`): an argument object
given to several ranks is counted once, as `stored_once` puts it in Ray's object store once; every other
argument once per rank (passed by value); a rank's result only where it replies (`run_dropping_results`
sends nothing back). Each call of a chain is recorded on its own, with the round trip it was part of. Sizes are pickled sizes
(Ray serializes tensors with pickle; a view carries its whole storage, as there). Each rank gets its
own unpickled copy, as a Ray actor does. The ranks host `StandInWorker`s: `PolicyWorker`'s own
staging methods around arithmetic stand-ins for the Megatron roles, whose updates check that every
field reached them in the right rows.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

import megarl.trainer.trainer as trainer_module
from megarl.algorithms.kl import FixedKLController
from megarl.cluster.roles import MegatronGroup, Roles, packs_by_tokens
from megarl.cluster.running import RunningCluster
from megarl.cluster.timing import PhaseTimer
from megarl.config.batch_plan import plan_batches
from megarl.config.loader import load_config
from megarl.config.rollout import response_length
from megarl.data.prompts import Prompt
from megarl.models.hf_config import ModelDims
from megarl.orchestration.worker_group import Call, _count_round_trip
from megarl.rollout.samples import Samples
from megarl.trainer.generated import GeneratedBatch
from megarl.trainer.rollout_stream import RolloutStream
from megarl.workers.policy_worker import PolicyWorker
from megarl.workers.profiling import StepProfiler

TINY_DIMS = ModelDims(
    "qwen2",
    vocab_size=100,
    hidden_size=64,
    ffn_hidden_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
    qk_layernorm=False,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    rope_scaling=None,
    max_position_embeddings=128,
    initializer_range=0.02,
    attention_dropout=0.0,
)
"""For the step's update FLOPs (a number the recording does not read)."""


def old_log_probs_of(batch) -> torch.Tensor:
    return -batch.responses.float() / 100


def ref_log_probs_of(batch) -> torch.Tensor:
    return -batch.responses.float() / 200


def values_of(batch) -> torch.Tensor:
    return batch.responses.float() / 1000


class StandInWorker:
    """A `PolicyWorker` whose roles are arithmetic on the response tokens; staging is `PolicyWorker`'s own."""

    stage_batch = PolicyWorker.stage_batch
    call_staged = PolicyWorker.call_staged
    staged_field = PolicyWorker.staged_field
    drop_staged = PolicyWorker.drop_staged
    stop_profile = PolicyWorker.stop_profile

    def __init__(self, actor_reads: tuple[str, ...], rank: int = 0, group: str = "actor"):
        """`rank`, `group`: the rank's place, as `PolicyWorker`'s profiler names its traces."""
        self.staged = None
        self.profiler = StepProfiler(group, rank=rank, cuda=False)
        self.actor_reads = actor_reads
        """The fields the actor's loss reads (`PolicyLoss.required_fields` of the run)."""

    def compute_log_prob(self, batch):
        return old_log_probs_of(batch), torch.zeros(batch.responses.shape)  # log-probs, entropy

    def compute_ref_log_prob(self, batch):
        return ref_log_probs_of(batch)

    def compute_values(self, batch):
        return values_of(batch)

    def compute_rm_scores(self, batch):
        return batch.responses[:, 0].float() / 1000

    def update_actor(self, batch, step: int) -> dict[str, float]:
        batch.require(self.actor_reads, "StandInWorker.update_actor")
        for name, expected in (("old_log_probs", old_log_probs_of), ("ref_log_probs", ref_log_probs_of)):
            if name in self.actor_reads:
                assert torch.equal(getattr(batch, name), expected(batch)), f"{name} reached the actor in wrong rows"
        counted = batch.response_mask if batch.loss_mask is None else batch.loss_mask
        return {"loss": float(step), "tokens": float(counted.sum())}

    def update_critic(self, batch, step: int) -> dict[str, float]:
        batch.require(("values", "returns"), "StandInWorker.update_critic")
        assert torch.equal(batch.values, values_of(batch)), "values reached the critic in wrong rows"
        return {"loss": float(step), "tokens": float(batch.response_mask.sum())}


@dataclass
class Recorded:
    """One call of a group (one step of a chain): what it sent and what came back."""

    method: str
    """The worker method (for `call_staged`, the method it runs: "call_staged:update_actor")."""
    sent: dict[str, int]
    """Pickled bytes per payload: a `PolicyBatch` field name (a staged part's fields, or a `call_staged`
    field), or "other" for the rest of the arguments."""
    received: int
    """Pickled bytes of the results that came back."""
    replies: int
    """How many ranks sent their result back."""
    fields_sent: list[str] = field(default_factory=list)
    """The `PolicyBatch` fields among the arguments, once per object sent."""
    kept: str | None = None
    trip: int = 0
    """The group's round trip the call was part of (counted from 0)."""


def _size(value) -> int:
    return len(pickle.dumps(value))


def _payload(args: tuple) -> tuple[dict[str, int], list[str]]:
    """Bytes of one argument tuple by `PolicyBatch` field (a batch, or a dict of fields) and the rest."""
    sent, fields = {"other": 0}, []
    for arg in args:
        tensors = vars(arg) if hasattr(arg, "prompt_mask") else arg if isinstance(arg, dict) else None
        if tensors is None:
            sent["other"] += _size(arg)
            continue
        for name, rows in tensors.items():
            if rows is not None:
                sent[name] = sent.get(name, 0) + _size(rows)
                fields.append(name)
    return sent, fields


class RecordingWorkers:
    """A `WorkerGroup` stand-in of `world_size` `StandInWorker`s that records every call (`Recorded`)."""

    def __init__(self, world_size: int, actor_reads: tuple[str, ...], group: str = "actor"):
        self.world_size = world_size
        self.ranks = [StandInWorker(actor_reads, rank, group) for rank in range(world_size)]
        self.calls: list[Recorded] = []
        self.trips = 0
        """Round trips so far (each `submit`)."""

    def submit(self, per_rank_calls: list[list[Call]], replying=None) -> Answered:
        """Every rank runs its chain (the same methods on every rank), each call on its own unpickled copy
        of the arguments; answered at once."""
        assert len(per_rank_calls) == self.world_size, "one chain of calls per rank"
        replying = [True] * self.world_size if replying is None else list(replying)
        _count_round_trip()  # the run's `perf/round_trips`, as `WorkerGroup.submit` counts it
        answers: list[list] = [[] for _ in self.ranks]
        for calls in zip(*per_rank_calls, strict=True):
            distinct = {id(arg): arg for call in calls for arg in call.args}  # `stored_once`: one copy each
            sent, fields = _payload(tuple(distinct.values()))
            received = 0
            for worker, call, reply, rank_answers in zip(self.ranks, calls, replying, answers, strict=True):
                result = getattr(worker, call.method)(*pickle.loads(pickle.dumps(call.args)))
                received += _size(result) if reply else 0
                rank_answers.append(result)
            method, args = calls[0].method, calls[0].args
            name = f"{method}:{args[0]}" if method == "call_staged" else method
            kept = args[2] if method == "call_staged" else None
            self.calls.append(Recorded(name, sent, received, sum(replying), fields, kept, self.trips))
        self.trips += 1
        return Answered([rank if reply else None for rank, reply in zip(answers, replying)])

    def chain(self, *calls: Call) -> list[list]:
        return self.submit([list(calls)] * self.world_size).wait()

    def call_each(self, method: str, per_rank_args: list[tuple], replying=None) -> list:
        answers = self.submit([[Call(method, args)] for args in per_rank_args], replying).wait()
        return [None if rank is None else rank[0] for rank in answers]

    def call_all(self, method: str, *args) -> list:
        return self.call_each(method, [args] * self.world_size)

    def call_rank0(self, method: str, *args):
        _count_round_trip()
        result = getattr(self.ranks[0], method)(*pickle.loads(pickle.dumps(args)))
        self.calls.append(Recorded(method, {"other": _size(args)}, _size(result), 1, trip=self.trips))
        self.trips += 1
        return result


@dataclass
class Answered:
    """`megarl.orchestration.worker_group.PendingCall` of a stand-in group: answered when submitted."""

    answers: list

    def poll(self, timeout_s: float) -> bool:
        return True

    def wait(self) -> list:
        return self.answers


def grids(tp: int, pp: int, dp: int) -> list[dict[str, int]]:
    """megatron-core's rank order: TP fastest, then DP, then PP (as `PolicyWorker.grid`)."""
    return [
        dict(rank=r, tp_rank=r % tp, dp_rank=(r // tp) % dp, pp_rank=r // (tp * dp), dp_size=dp)
        for r in range(tp * pp * dp)
    ]


def recording_roles(config, plan) -> Roles:
    """The run's Megatron groups (`start_roles`' layout) as recording stand-ins."""
    actor_reads = ["advantages", "rollout_log_probs"]  # the engines' log-probs: mismatch metrics, every step
    if plan.old_log_prob_pass:
        actor_reads.append("old_log_probs")
    if config.actor.use_kl_loss:
        actor_reads.append("ref_log_probs")
    started = {}
    for role in (plan.actor, plan.critic, plan.ref):
        if role is None:
            continue
        name = role.role if role.own_group else "policy"
        if name not in started:
            layout = grids(role.tensor_parallel, role.pipeline_parallel, role.data_parallel)
            started[name] = MegatronGroup(RecordingWorkers(len(layout), tuple(actor_reads), role.role), layout)
    groups = {
        role.role: started[role.role if role.own_group else "policy"]
        for role in (plan.actor, plan.critic, plan.ref)
        if role is not None
    }
    packed = frozenset(name for name in groups if packs_by_tokens(getattr(config, name), config))
    return Roles(groups, rollout=None, placement=None, sync_transport="collective", routes=None, packed_roles=packed)


def samples_of(config, plan, seed: int) -> tuple[Samples, torch.Tensor]:
    """One step's samples: prompts and responses of random lengths up to the run's limits, and scores."""
    generator = torch.Generator().manual_seed(seed)
    n, limit = config.rollout.n, response_length(config.rollout)
    prompts = [
        Prompt(
            f"p{k}",
            tuple(range(1, 2 + int(torch.randint(config.data.max_prompt_length, (1,), generator=generator)))),
            None,
            {},
            "test",
        )
        for k in range(plan.prompts_per_step)
    ]
    samples = Samples.empty()
    for k, prompt in enumerate(prompts):
        for _ in range(n):
            length = 1 + int(torch.randint(limit, (1,), generator=generator))
            samples.prompts.append(prompt)
            samples.response_ids.append(torch.randint(3, 100, (length,), generator=generator).tolist())
            samples.rollout_log_probs.append(-torch.rand(length, generator=generator))
            samples.loss_masks.append(torch.ones(length, dtype=torch.bool))
            samples.finish_reasons.append("stop")
            samples.index.append(f"{seed}/{k}")
            samples.trajectories.append(None)
    return samples, torch.rand(len(samples), generator=generator)


def recorded_trainer(config_path, overrides: list[str]) -> trainer_module.Trainer:
    """A `Trainer` of the recipe whose Megatron groups are recording stand-ins (no Ray, no models)."""
    trainer = trainer_module.Trainer.__new__(trainer_module.Trainer)
    trainer.config = config = load_config(config_path, overrides)
    trainer.plan = plan = plan_batches(config)
    # The run's own cluster over the recording groups; no engines, so nothing to hand over.
    trainer.cluster = RunningCluster(recording_roles(config, plan), SimpleNamespace(to_training=lambda: None))
    trainer.timer, trainer.stop_ids, trainer.multi_turn = PhaseTimer(), (), config.rollout.multi_turn
    trainer.kl_ctrl = FixedKLController(config.algorithm.kl_ctrl.kl_coef)
    trainer.model_dims = TINY_DIMS
    return trainer


def run_step(trainer, step: int) -> dict[str, float]:
    """`Trainer._train_step` on this step's `samples_of` (the rollout phase's result, as a sync-mode stream hands it over)."""
    return run_step_on(trainer, step, *samples_of(trainer.config, trainer.plan, seed=step))


def run_step_on(trainer, step: int, samples, scores) -> dict[str, float]:
    """`Trainer._train_step` on the given rollout result, as a sync-mode stream hands it over."""
    trainer.stream = RolloutStream(
        lambda at_step, version: GeneratedBatch(samples, scores.clone(), {}, None, version),
        trainer.timer,
        trainer.timer,
        lookahead=0,
        last_step=step,
        version=step - 1,
    )
    return trainer._train_step(step)
