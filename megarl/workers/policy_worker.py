"""One Megatron rank: its shards of the roles its group hosts (the actor and the roles that share
its layout; or a critic or reference with a layout of its own), and with the actor the sending side
of the weight sync. A plain class; `megarl.orchestration` hosts one per rank process.

    worker = PolicyWorker(spec)                       # builds the grid, loads the HF weights
    old_log_probs, entropy = worker.compute_log_prob(batch)
    metrics = worker.update_actor(batch, shuffle_seed=step)
    stats = worker.send_weights()                     # collective; the sending ranks feed the engines

megatron-core keeps one (TP, PP) grid per process, so every role a worker hosts has the spec's
layout. Every rank of a DP replica holds the same `PolicyBatch` (that replica's rows); results are
returned on every rank. In training the driver stages a step's rows once (`stage_batch`) and runs
the methods on them by name (`call_staged`), adding only the fields new since
(`megarl.cluster.staged_batch`).
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist
from torch import Tensor

from megarl.bridge import LayoutPair, ShardSender, SyncPlan, WeightSender, build_plan
from megarl.bridge.checksum import rank_checksums
from megarl.bridge.collect import sync_rank
from megarl.bridge.per_rank import PerRankSender
from megarl.bridge.ring_routes import RingRoutes
from megarl.bridge.scheduled_ring import ScheduledRingSender
from megarl.bridge.sync_group import create_weight_sync_group, listen_weight_sync_store
from megarl.bridge.transports.cuda_ipc import CudaIpcTransport
from megarl.bridge.transports.shared_memory import SharedMemoryTransport
from megarl.models.hf_config import read_model_dims
from megarl.models.model_options import TORCH_DTYPES
from megarl.parallel.device import uses_cuda
from megarl.parallel.distributed import initialize_model_parallel
from megarl.workers.actor import MegatronActor, PolicyLoss
from megarl.workers.batch import PolicyBatch
from megarl.workers.checkpoint import export_hf, load_checkpoint, save_checkpoint
from megarl.workers.critic import MegatronCritic
from megarl.workers.matmul_peak import measure_matmul_peak
from megarl.workers.megatron_train import compute_device
from megarl.workers.memory_stats import free_device_memory, memory_stats
from megarl.workers.profiling import ProfileRequest, StepProfiler
from megarl.workers.reference import MegatronReference
from megarl.workers.reward_model import MegatronRewardModel
from megarl.workers.settings import PolicyWorkerSpec
from megarl.workers.sync_probe import actor_probe_logprobs


class PolicyWorker:
    """The Megatron roles of one rank."""

    def __init__(self, spec: PolicyWorkerSpec):
        self.spec = spec
        self.groups = initialize_model_parallel(
            spec.tp, spec.pp, spec.seed, vpp=spec.vpp, ep=spec.ep, etp=spec.etp, cp=spec.cp
        )
        self.sync_groups = self.groups.weight_replicas()
        """The grid the weight sync is given: with context parallelism, CP rank 0 of DP replica 0 sends."""
        actor, model = spec.actor, spec.model
        self.actor = (
            MegatronActor.from_hf(
                spec.model_path,
                self.groups,
                optim=actor.section.optim,
                lr_decay_steps=actor.lr_decay_steps,
                model=model,
                recompute=actor.section.recompute,
                offload=actor.section.offload,
                sequence_parallel=actor.section.parallel.sequence_parallel,
                moe=actor.section.moe,
            )
            if actor
            else None
        )
        self.reference = (
            MegatronReference.from_hf(
                spec.model_path,
                self.groups,
                model=model,
                sequence_parallel=spec.ref_sequence_parallel,
                router_replay=spec.ref_router_replay,
            )
            if spec.use_reference
            else None
        )
        if self.reference is not None and spec.ref_offload:
            self.reference.offload()
        critic = spec.critic
        self.critic = (
            MegatronCritic.from_hf(
                spec.model_path,
                self.groups,
                optim=critic.section.optim,
                lr_decay_steps=critic.lr_decay_steps,
                loss=critic.section,
                model=model,
                recompute=critic.section.recompute,
                offload=critic.section.offload,
                sequence_parallel=critic.section.parallel.sequence_parallel,
            )
            if critic
            else None
        )
        self.reward_model = (
            MegatronRewardModel.from_hf(spec.reward_model_path, self.groups, model=model)
            if spec.reward_model_path
            else None
        )
        self.loss = (
            PolicyLoss(actor.section, report_mismatch=True) if actor else None
        )  # the engines always report log-probs
        # The weights travel in the engines' dtype: a cast on the sender halves an fp32 actor's bytes for bf16 engines.
        self.plan = (
            build_plan(
                read_model_dims(spec.model_path),
                LayoutPair(
                    spec.tp,
                    spec.pp,
                    actor.rollout_tp,
                    spec.vpp,
                    train_ep=spec.ep,
                    train_etp=spec.etp,
                    rollout_ep=actor.rollout_expert_parallel,
                ),
                bucket_mb=actor.bucket_mb,
                dtype=TORCH_DTYPES[actor.rollout_dtype],
            )
            if actor
            else None
        )
        self.sender: WeightSender | None = None
        self.staged: PolicyBatch | None = None
        """This replica's rows of the step's batch (`stage_batch`), with the fields kept or added since."""
        group = "actor" if actor else "critic" if critic else "ref"  # the group's first role, as the driver names it
        self.profiler = StepProfiler(group, rank=dist.get_rank(), cuda=uses_cuda())

    def grid(self) -> dict[str, int | None]:
        """This rank's place in the (TP, PP, DP) grid, and with an actor its sender index in the weight sync's
        schedule (`sync_sender`, `bridge.collect.sync_rank`; None: it sends nothing)."""
        g = self.groups
        return dict(
            rank=dist.get_rank(),
            tp_rank=g.tp_rank,
            pp_rank=g.pp_rank,
            dp_rank=g.dp_rank,
            dp_size=g.dp_size,
            sync_replica=self.sync_groups.dp_rank,
            sync_sender=None if self.plan is None else sync_rank(self.plan.layout, self.sync_groups),
        )

    def stage_batch(self, batch: PolicyBatch, profile: ProfileRequest | None = None) -> None:
        """Hold this replica's rows of the step's batch for the step's `call_staged` calls, in place of
        the last step's; with a `profile` request that names this rank, record the step until `stop_profile`."""
        self.staged = batch
        self.profiler.start(profile)

    def stop_profile(self) -> str | None:
        """After a profiled step's weight sync: the step's trace written; its path (None: this rank did not record)."""
        return self.profiler.stop()

    def call_staged(self, method: str, fields: dict[str, Tensor], keep: str | None, output: int | None, *args):
        """`method(staged batch, *args)` once `fields` (name -> this replica's `[b, ...]` rows) are added
        to the staged batch; its result (output `output` of a tuple), also kept as the staged batch's
        field `keep`."""
        if self.staged is None:
            raise ValueError(
                f"PolicyWorker.call_staged({method!r}): no batch is staged on this rank; "
                "stage_batch the step's rows first"
            )
        self.staged = dataclasses.replace(self.staged, **fields)
        with self.profiler.phase(method):
            result = getattr(self, method)(self.staged, *args)
        if output is not None:
            result = result[output]
        if keep is not None:
            self.staged = dataclasses.replace(self.staged, **{keep: result})
        return result

    def staged_field(self, name: str) -> Tensor:
        """`[b, ...]` one field of the staged batch (a result kept by `call_staged`)."""
        if self.staged is None or getattr(self.staged, name) is None:
            raise ValueError(f"PolicyWorker.staged_field: PolicyBatch.{name} is not staged on this rank")
        return getattr(self.staged, name)

    def drop_staged(self) -> None:
        """The step is over: free its rows."""
        self.staged = None

    def compute_log_prob(self, batch: PolicyBatch) -> tuple[Tensor, Tensor]:
        """`[B, R]` log-probs and entropy of the responses under the current actor."""
        return self.actor.compute_log_prob(batch, micro_batch_size=self.spec.actor.forward_micro_batch)

    def compute_ref_log_prob(self, batch: PolicyBatch) -> Tensor:
        """`[B, R]` reference log-probs (with `ref_offload`, the weights come to the device for this pass only)."""
        if self.spec.ref_offload:
            self.reference.onload()
        log_probs = self.reference.compute_ref_log_prob(batch, micro_batch_size=self.spec.ref_micro_batch)
        if self.spec.ref_offload:
            self.reference.offload()
        return log_probs

    def offload_training_state(self) -> dict[str, float]:
        """After the updates: the actor's and critic's gradients and optimizer state that their `offload`
        settings name leave the device (on CPU: the gradient buffers are freed, the rest stays); the parameters stay for the weight sync. This
        process's memory afterwards (`memory_stats`)."""
        with self.profiler.phase("offload_training_state"):
            for model in self._trained_models():
                model.offload_training_state()
        return memory_stats()

    def offload_params(self) -> dict[str, float]:
        """After the weight sync: their parameters too, where `offload.params` says so; `onload` before
        any other call on them. This process's memory afterwards."""
        with self.profiler.phase("offload_params"):
            for model in self._trained_models():
                model.offload_params()
        return memory_stats()

    def onload(self) -> dict[str, float]:
        """Undo both offloads, before the next log-prob pass or update. This process's memory afterwards."""
        for model in self._trained_models():
            model.onload()
        return memory_stats()

    def memory_stats(self) -> dict[str, float]:
        """This process's memory now (`megarl.workers.memory_stats`)."""
        return memory_stats()

    def free_device_memory(self) -> tuple[float, float] | None:
        """(free, total) GiB of this rank's GPU; None on CPU (`megarl.workers.memory_stats`)."""
        return free_device_memory()

    def matmul_peak(self) -> float:
        """FLOP/s of a matmul benchmark in the model's dtype on this rank's device; call it on every rank
        at once (`megarl.workers.matmul_peak`)."""
        return measure_matmul_peak(TORCH_DTYPES[self.spec.model.dtype], compute_device())

    def _trained_models(self) -> list:
        return [model for model in (self.actor, self.critic) if model is not None]

    def compute_rm_scores(self, batch: PolicyBatch) -> Tensor:
        """`[B]` reward-model scores of the samples (at each one's last token)."""
        return self.reward_model.compute_scores(batch, micro_batch_size=self.spec.ref_micro_batch_size)

    def compute_values(self, batch: PolicyBatch) -> Tensor:
        return self.critic.compute_values(batch, micro_batch_size=self.spec.critic.forward_micro_batch)

    def update_actor(self, batch: PolicyBatch, shuffle_seed: int) -> dict[str, float]:
        s = self.spec.actor
        return self.actor.update_policy(
            batch,
            self.loss,
            mini_batch_size=s.mini_batch_size,
            micro_batch_size=s.micro_batch_size,
            ppo_epochs=s.section.ppo_epochs,
            shuffle_seed=shuffle_seed,
        )

    def update_critic(self, batch: PolicyBatch, shuffle_seed: int) -> dict[str, float]:
        c = self.spec.critic
        return self.critic.update_critic(
            batch,
            mini_batch_size=c.mini_batch_size,
            micro_batch_size=c.micro_batch_size,
            ppo_epochs=c.section.ppo_epochs,
            shuffle_seed=shuffle_seed,
        )

    def listen_weight_sync(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Global rank 0: open the weight-sync group's store; where the other ranks should connect."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._sync_store = listen_weight_sync_store(host, world_size, timeout_s)
        return host, self._sync_store.port

    def connect_weight_sync(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        """Collective over the trainer ranks: the ranks of DP replica 0 and of the first expert-DP
        replica join the sync group at their sender ranks (global rank 0 on its store) and wait for the engines (whose
        `RolloutWorker.start_weight_sync` must be running); every sync, each sends its own shards."""
        group, groups = None, self.sync_groups
        rank = sync_rank(self.plan.layout, groups)
        if rank is not None:
            store = self._sync_store if rank == 0 else None
            group = create_weight_sync_group(host, port, rank, world_size, timeout_s, store=store)
        self.sender = ShardSender(self.plan, self.actor.named_parameters_for_sync, groups, group)

    def use_shared_weight_sync(self, kind: str, routes: RingRoutes, timeout_s: float) -> None:
        """Collective over the trainer ranks: stream every sync through shared slots on this node
        (`kind` "shared_memory": /dev/shm; "cuda_ipc": this rank's GPU) along `routes`: this rank hosts
        a ring of `routes.readers[rank]` engine workers (none: it sends nothing), carrying its own
        shards in vLLM's per-rank layout ("per_rank"), its device's worker's tensors assembled from the
        planner's pieces ("scheduled") or the gathered buckets (`megarl.bridge.ring_routes`). Each
        sync starts with `begin_weight_sync`."""
        shared = {"shared_memory": SharedMemoryTransport, "cuda_ipc": CudaIpcTransport}[kind]
        readers = routes.readers[dist.get_rank()]
        transport = shared(readers, timeout_s=timeout_s) if readers else None
        named = self.actor.named_parameters_for_sync
        groups = self.sync_groups
        if routes.mode == "per_rank":
            self.sender = PerRankSender(self.plan, named, groups, transport)
        elif routes.mode == "scheduled":
            self.sender = ScheduledRingSender(self.plan, named, groups, routes, transport)
        else:
            self.sender = WeightSender(self.plan, named, groups, transport, every_rank=routes.mode == "every_rank")

    def begin_weight_sync(self):
        """Shared transports: open the next sync's slots; the ring the engines load from
        (`RolloutWorker.start_receive` of `SharedRings` / `RankRings`, along the ring routes), before
        `send_weights`. None on ranks that host no ring."""
        transport = self.sender.transport
        return None if transport is None else transport.begin()

    def sync_plan(self) -> SyncPlan:
        """The plan of every sync, which the engines receive by (`RolloutWorker.start_receive(CollectivePlan(plan))`)."""
        return self.plan

    def send_weights(self) -> dict[str, float]:
        """Collective: every bucket of the plan reaches the engines (each sending rank's shards, or
        rank 0's gathered buckets through its shared transport)."""
        with self.profiler.phase("send_weights"):
            return self.sender.send().metrics()

    def weight_checksums(self, dtype: str) -> dict[str, int]:
        """This rank's partial checksums, in `dtype` (the engines'), of the HF tensors the engines must
        hold, from its live shards (`bridge.checksum.rank_checksums`; the driver sums over the ranks)."""
        return rank_checksums(self.plan, self.actor.named_parameters_for_sync(), self.sync_groups, dtype)

    def probe_log_probs(self, token_ids: list[list[int]]) -> Tensor:
        """`[B, T-1]` actor log-probs of the sync probe (collective)."""
        return actor_probe_logprobs(self.actor, token_ids)

    def skipped_steps(self) -> dict[str, int]:
        return {role: model.skipped_steps for role, model in self._trained().items()}

    def save_checkpoint(self, root: str, step: int, extra: dict) -> str:
        """Collective: the hosted actor and critic's weights, optimizer and scheduler states, this
        rank's RNG and the driver's `extra`, written atomically as `<root>/step_<step>`."""
        return str(save_checkpoint(root, step, self.groups, **self._trained_states(), extra=extra))

    def load_checkpoint(self, path: str) -> dict:
        """Collective: restore a checkpoint written by `save_checkpoint` in place; its `extra`."""
        return load_checkpoint(path, self.groups, **self._trained_states())

    def _trained(self) -> dict[str, MegatronActor | MegatronCritic]:
        return {role: model for role, model in (("actor", self.actor), ("critic", self.critic)) if model}

    def _trained_states(self) -> dict[str, dict]:
        engines = {role: model.engine for role, model in self._trained().items()}
        return dict(
            models={role: e.chunks for role, e in engines.items()},
            optimizers={role: e.optimizer for role, e in engines.items()},
            schedulers={role: e.scheduler for role, e in engines.items()},
        )

    def export_hf(self, root: str) -> str | None:
        """Collective: the actor's weights as an HF checkpoint dir `<root>/hf` (written by one rank)."""
        path = export_hf(
            [chunk.module for chunk in self.actor.engine.chunks], root, self.groups, hf_assets_dir=self.spec.model_path
        )
        return None if path is None else str(path)
