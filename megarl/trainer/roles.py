"""The processes of a run: a policy group (the actor and every role with its layout, one Megatron
world), a group per role with a layout of its own (`BatchPlan.own_groups`: its own processes, world
and grid), and a rollout group (one engine per worker), placed on Ray, with the weight-sync group
wired between the policy and the rollout.

Routing. `Roles.gather` / `Roles.update` send each worker method to the group of its role
(`METHOD_ROLES`) and scatter the batch by that group's DP size.

Placement. One bundle per device (a GPU, or one CPU slot on a CPU machine). The policy group and
each role group of its own share the training bundles: one process each on every training bundle,
each with an equal share of its GPU and one CPU. Colocated: the rollout engines share those bundles
too; split: the rollout gets `placement.rollout_gpus` bundles of its own after the trainer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from megarl.config import BatchPlan, Config, ConfigError, cluster_problems, resolve_device, uses_reference
from megarl.orchestration.cluster import cluster_gpus
from megarl.orchestration.placement import BundleSpec, PlacementError, create_placement_group
from megarl.orchestration.worker_group import WorkerGroup
from megarl.parallel.device import worker_env
from megarl.trainer import settings
from megarl.trainer.checkpoint_manager import part_dir
from megarl.trainer.rollout_batch import gather_by_dp
from megarl.workers.batch import PolicyBatch
from megarl.workers.checkpoint_files import step_dir_name
from megarl.workers.megatron_train import ModelSettings
from megarl.workers.policy_worker import ActorSpec, CriticSpec, PolicyWorkerSpec

POLICY_TARGET = "megarl.workers.policy_worker:PolicyWorker"
ROLLOUT_TARGET = "megarl.workers.rollout.rollout_worker:RolloutWorker"
SYNC_TIMEOUT_S = 300.0
METHOD_ROLES = {
    "compute_log_prob": "actor", "update_actor": "actor", "compute_ref_log_prob": "ref",
    "compute_values": "critic", "update_critic": "critic",
    "compute_rm_scores": "actor",  # the reward model lives in the actor's processes
}
"""The role whose group runs each per-sample worker method."""


@dataclass
class MegatronGroup:
    """A worker group of Megatron ranks (`PolicyWorker`s) and each rank's place in its grid."""

    workers: WorkerGroup
    grids: list[dict[str, int]]
    """Per rank: rank, tp_rank, pp_rank, dp_rank, dp_size."""

    @classmethod
    def start(cls, name: str, spec: PolicyWorkerSpec, world_size: int, placement, bundle: BundleSpec,
              env: dict[str, str]) -> MegatronGroup:
        workers = WorkerGroup(name, POLICY_TARGET, world_size, placement, bundle, init_kwargs={"spec": spec}, env=env)
        return cls(workers, workers.call_all("grid"))

    @property
    def dp_size(self) -> int:
        return self.grids[0]["dp_size"]

    def call_by_dp(self, method: str, per_dp: list[tuple]) -> list:
        """Each rank runs `method` with its DP replica's arguments; results in rank order."""
        return self.workers.call_each(method, [per_dp[g["dp_rank"]] for g in self.grids])


@dataclass
class Roles:
    """The running worker groups of a job."""

    groups: dict[str, MegatronGroup]
    """Each Megatron role of the run (actor, critic, ref) -> the group hosting it: the actor's group
    (`policy`) or one of its own."""
    rollout: WorkerGroup
    placement: object
    sync_transport: str
    """How the weights reach the engines: "collective", "shared_memory" or "cuda_ipc" (`rollout.sync.transport`
    resolved for this placement)."""
    per_rank: bool
    """Each trainer TP rank streams its own shards to engine worker r (`rollout.sync.per_rank` resolved)."""

    @property
    def policy(self) -> WorkerGroup:
        """The actor's group (it syncs the weights, exports the actor)."""
        return self.groups["actor"].workers

    @property
    def grids(self) -> list[dict[str, int]]:
        """The actor's grid, per policy rank."""
        return self.groups["actor"].grids

    @property
    def own_groups(self) -> dict[str, MegatronGroup]:
        """The roles that run in groups of their own."""
        return {role: group for role, group in self.groups.items() if group is not self.groups["actor"]}

    def gather(self, method: str, batch: PolicyBatch, index: int | None = None) -> Tensor:
        """Run a per-sample method on each DP replica of its role's group; the rows back in order
        (`index` picks one output of methods that return a tuple)."""
        group = self.groups[METHOD_ROLES[method]]
        parts = group.call_by_dp(method, [(part,) for part in batch.split(group.dp_size)])
        if index is not None:
            parts = [part[index] for part in parts]
        return gather_by_dp(parts, group.grids)

    def update(self, method: str, batch: PolicyBatch, step: int) -> dict[str, float]:
        """An update (`update_actor` / `update_critic`) on each DP replica's rows of its role's group;
        the metrics of DP replica 0 (they are reduced over DP inside the update)."""
        group = self.groups[METHOD_ROLES[method]]
        results = group.call_by_dp(method, [(part, step) for part in batch.split(group.dp_size)])
        return next(r for g, r in zip(group.grids, results) if g["rank"] == 0)

    def save_checkpoint(self, root: str, step: int, extra: dict) -> None:
        """Collective on every group with trained state: a critic of its own writes its part
        (`checkpoint_manager.part_dir`) first, then the actor's group commits `<root>/step_<step>`,
        so a complete step dir implies complete parts."""
        step_dir = Path(root) / step_dir_name(step)
        for role, group in self._own_trained().items():
            group.workers.call_all("save_checkpoint", str(part_dir(step_dir, role).parent), step, extra)
        self.policy.call_all("save_checkpoint", root, step, extra)

    def load_checkpoint(self, path: str) -> dict:
        """Collective: restore every group from the checkpoint `path` (and its parts); its `extra`."""
        for role, group in self._own_trained().items():
            group.workers.call_all("load_checkpoint", str(part_dir(Path(path), role)))
        return self.policy.call_all("load_checkpoint", path)[0]

    def offload(self) -> None:
        """Every Megatron group moves what `actor.offload` / `critic.offload` name to host memory, so a
        colocated rollout has the devices (`PolicyWorker.offload`); `onload` before they run again."""
        for group in self._distinct_groups():
            group.workers.call_all("offload")

    def onload(self) -> None:
        """Undo `offload`."""
        for group in self._distinct_groups():
            group.workers.call_all("onload")

    def _distinct_groups(self) -> list[MegatronGroup]:
        return list({id(group): group for group in self.groups.values()}.values())

    def _own_trained(self) -> dict[str, MegatronGroup]:
        """Groups of their own whose role has state to checkpoint (the reference is the initial model)."""
        return {role: group for role, group in self.own_groups.items() if role != "ref"}

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self.rollout.kill()
        for group in self._distinct_groups():
            group.workers.kill()
        remove_placement_group(self.placement)


def cluster_device(config: Config) -> str:
    """`trainer.device` resolved on the running Ray cluster ("cpu" or "cuda"); `ConfigError` for what the
    cluster cannot host (`validate` already refused what no cluster could)."""
    gpus = cluster_gpus()
    problems = cluster_problems(config, gpus)
    if problems:
        raise ConfigError(problems)
    return resolve_device(config.trainer.device, gpus)


def worker_specs(config: Config, plan: BatchPlan, total_steps: int) -> dict[str, PolicyWorkerSpec]:
    """The spec of each Megatron group: "policy" (the actor and every role without a group of its
    own), then one per role in `plan.own_groups`, named after it."""
    own = {role.role for role in plan.own_groups}
    model = ModelSettings(dtype=config.model.dtype, transformer_impl=config.model.transformer_impl)
    critic = critic_spec(config, plan, total_steps) if plan.critic else None
    policy = PolicyWorkerSpec(
        model_path=config.model.path, model_settings=model, tp=plan.actor.tensor_parallel, pp=plan.actor.pipeline_parallel,
        seed=config.trainer.seed, actor=actor_spec(config, plan, total_steps),
        use_reference=plan.ref is not None and "ref" not in own, ref_micro_batch_size=config.ref.micro_batch_size_per_gpu,
        ref_offload=config.ref.offload_params, critic=None if "critic" in own else critic,
        reward_model_path=config.reward.reward_model,
    )
    specs = {"policy": policy}
    for role in plan.own_groups:
        specs[role.role] = PolicyWorkerSpec(
            model_path=config.model.path, model_settings=model, tp=role.tensor_parallel, pp=role.pipeline_parallel,
            seed=config.trainer.seed,
            actor=None, use_reference=role.role == "ref", ref_micro_batch_size=config.ref.micro_batch_size_per_gpu,
            ref_offload=config.ref.offload_params, critic=critic if role.role == "critic" else None,
            reward_model_path=None,
        )
    return specs


def actor_spec(config: Config, plan: BatchPlan, total_steps: int) -> ActorSpec:
    actor = config.actor
    return ActorSpec(
        optim=settings.optim_settings(actor.optim, settings.total_optimizer_steps(plan, "actor", total_steps)),
        recompute=settings.recompute_settings(actor.recompute),
        loss=settings.policy_loss_settings(config),
        offload=settings.offload_settings(actor.offload),
        mini_batch_size=plan.actor.update.samples_per_rank,
        micro_batch_size=actor.micro_batch_size_per_gpu,
        ppo_epochs=actor.ppo_epochs,
        rollout_tp=config.rollout.tensor_model_parallel_size,
        bucket_mb=config.rollout.sync.bucket_mb,
    )


def critic_spec(config: Config, plan: BatchPlan, total_steps: int) -> CriticSpec:
    critic = config.critic
    return CriticSpec(
        optim=settings.optim_settings(critic.optim, settings.total_optimizer_steps(plan, "critic", total_steps)),
        recompute=settings.recompute_settings(critic.recompute),
        loss=settings.value_loss_settings(config),
        offload=settings.offload_settings(critic.offload),
        mini_batch_size=plan.critic.update.samples_per_rank,
        micro_batch_size=critic.micro_batch_size_per_gpu,
        ppo_epochs=critic.ppo_epochs,
    )


def device_bundles(plan: BatchPlan) -> tuple[int, float]:
    """How many device bundles the job reserves, and the CPU cores of one: one for every process that
    shares a training bundle (`plan.processes_per_train_gpu`; a split rollout's bundles, one process
    each, have the same shape)."""
    bundles = plan.train_gpus + (0 if plan.colocated else plan.rollout_gpus)
    return bundles, float(plan.processes_per_train_gpu)


def process_share(bundle: BundleSpec, processes: int) -> BundleSpec:
    """What one of the `processes` that share a device bundle takes of it: one CPU and an equal share
    of its GPU (colocated, every Megatron group's rank and the engine sit on the same GPU)."""
    return BundleSpec(cpus=1.0, gpus=bundle.gpus / processes)


def start_roles(config: Config, plan: BatchPlan, total_steps: int, env: dict[str, str], device: str) -> Roles:
    """Place and start the Megatron groups and the rollout group on `device` (`cluster_device`), then
    connect the weight sync (a process group of the trainer's sending ranks and every engine, or the
    shared transports' rings)."""
    bundles, cpus = device_bundles(plan)
    bundle = BundleSpec(cpus=cpus, gpus=1.0 if device == "cuda" else 0.0)
    pg = create_placement_group("megarl", bundles, bundle)
    env = {**env, **worker_env(device)}
    share = process_share(bundle, plan.processes_per_train_gpu)
    started = {name: MegatronGroup.start(name, spec, plan.train_gpus, pg, share, env)
               for name, spec in worker_specs(config, plan, total_steps).items()}
    groups = {role.role: started[role.role if role.own_group else "policy"]
              for role in (plan.actor, plan.critic, plan.ref) if role is not None}
    rollout = config.rollout
    rollout_group = WorkerGroup(
        "rollout", ROLLOUT_TARGET, plan.rollout_engines, pg,
        BundleSpec(cpus=1.0, gpus=(share.gpus if plan.colocated else bundle.gpus) * rollout.tensor_model_parallel_size),
        init_kwargs={
            "backend": rollout.backend, "model_path": config.model.path,
            "tensor_parallel_size": rollout.tensor_model_parallel_size, "dtype": config.model.dtype,
            "seed": rollout.seed, "max_model_len": config.data.max_prompt_length + rollout.max_new_tokens,
            "cpu_kv_cache_gib": max(1, math.ceil(rollout.kv_cache_gib)),
            "gpu_memory_utilization": rollout.gpu_memory_utilization, "enforce_eager": rollout.enforce_eager,
        },
        env=env, first_bundle=0 if plan.colocated else plan.train_gpus,
    )
    policy = groups["actor"].workers
    transport = sync_transport(rollout.sync.transport, device, policy.node_ids()[0], rollout_group.node_ids())
    per_rank = per_rank_sync(config, transport)
    roles = Roles(groups, rollout_group, pg, transport, per_rank)
    if transport == "collective":
        connect_weight_sync(roles, rollout.tensor_model_parallel_size)
    else:
        # Per rank, each ring is read by one worker per engine; else rank 0's by every worker.
        readers = rollout_group.world_size * (1 if per_rank else rollout.tensor_model_parallel_size)
        policy.call_all("use_shared_weight_sync", transport, readers, SYNC_TIMEOUT_S, per_rank)
    return roles


def sync_transport(setting: str, device: str, sender_node: str, engine_nodes: list[str]) -> str:
    """`rollout.sync.transport` for this placement on `device`: the shared transports need every engine
    on the node of trainer rank 0 (the sender); auto takes shared memory there on CPU, else the collective."""
    same_node = set(engine_nodes) == {sender_node}
    if setting == "auto":
        return "shared_memory" if same_node and device == "cpu" else "collective"
    if setting != "collective" and not same_node:
        raise PlacementError(
            f"rollout.sync.transport={setting}: the shared transports need every rollout engine on the node of "
            f"trainer rank 0, but Ray placed engines on {len(set(engine_nodes) - {sender_node})} other node(s); "
            "use rollout.sync.transport: collective (or auto)"
        )
    return setting


def per_rank_sync(config: Config, transport: str) -> bool:
    """`rollout.sync.per_rank` for the resolved transport: the per-rank sync needs a shared transport,
    actor TP == rollout TP and the vLLM backend (validation refuses "always" with the latter two unmet)."""
    setting = config.rollout.sync.per_rank
    fits = (transport != "collective" and config.rollout.backend == "vllm"
            and config.actor.parallel.tensor_model_parallel_size == config.rollout.tensor_model_parallel_size)
    if setting == "always" and not fits:
        raise PlacementError(
            f"rollout.sync.per_rank=always: the per-rank sync streams through shared memory, but the weights go to the "
            f"engines by {transport} here (an engine is on another node than trainer rank 0); "
            "use rollout.sync.per_rank: auto"
        )
    return setting != "never" and fits


def connect_weight_sync(roles: Roles, rollout_tp: int) -> None:
    """The trainer's sending ranks (DP replica 0; global rank 0 hosts the store) and every engine's
    workers form one process group (`megarl.bridge.receiver_rank`: engine k's workers at
    senders + k·TP ...); the engines start joining first, then the trainer side completes it."""
    senders = sum(grid["dp_rank"] == 0 for grid in roles.grids)
    world = senders + roles.rollout.world_size * rollout_tp
    host, port = roles.policy.call_rank0("listen_weight_sync", world, SYNC_TIMEOUT_S)
    roles.rollout.call_each(
        "start_weight_sync",
        [(host, port, world, senders + k * rollout_tp, SYNC_TIMEOUT_S) for k in range(roles.rollout.world_size)],
    )
    roles.policy.call_all("connect_weight_sync", host, port, world, SYNC_TIMEOUT_S)
    roles.rollout.call_all("finish_weight_sync", SYNC_TIMEOUT_S)
