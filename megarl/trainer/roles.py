"""The processes of a run: a policy group (actor/reference/critic, one Megatron world) and a rollout
group (one engine per worker), placed on Ray, with the weight-sync group wired between them.

Placement. One bundle per device (a GPU, or one CPU slot on a CPU machine). Colocated: the rollout
engines share the trainer's bundles (each role takes half of the bundle's resources); split: the
rollout gets `placement.rollout_gpus` bundles of its own after the trainer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from megarl.config import BatchPlan, Config, ConfigError, cluster_problems, resolve_device, uses_reference
from megarl.orchestration.cluster import cluster_gpus
from megarl.orchestration.placement import BundleSpec, PlacementError, create_placement_group
from megarl.orchestration.worker_group import WorkerGroup
from megarl.parallel.device import worker_env
from megarl.trainer import settings
from megarl.trainer.rollout_batch import gather_by_dp
from megarl.workers.batch import PolicyBatch
from megarl.workers.megatron_train import ModelSettings
from megarl.workers.policy_worker import CriticSpec, PolicyWorkerSpec

POLICY_TARGET = "megarl.workers.policy_worker:PolicyWorker"
ROLLOUT_TARGET = "megarl.workers.rollout.rollout_worker:RolloutWorker"
SYNC_TIMEOUT_S = 300.0


@dataclass
class Roles:
    """The running worker groups of a job."""

    policy: WorkerGroup
    rollout: WorkerGroup
    grids: list[dict[str, int]]
    """Per policy rank: rank, tp_rank, pp_rank, dp_rank, dp_size."""
    placement: object
    sync_transport: str
    """How the weights reach the engines: "collective", "shared_memory" or "cuda_ipc" (`rollout.sync.transport`
    resolved for this placement)."""
    per_rank: bool
    """Each trainer TP rank streams its own shards to engine worker r (`rollout.sync.per_rank` resolved)."""

    @property
    def dp_size(self) -> int:
        return self.grids[0]["dp_size"]

    def gather(self, method: str, batch: PolicyBatch, index: int | None = None) -> Tensor:
        """Run a per-sample policy method on each DP replica's rows; the rows back in order
        (`index` picks one output of methods that return a tuple)."""
        parts = self.policy.call_each(method, self._by_rank([(part,) for part in batch.split(self.dp_size)]))
        if index is not None:
            parts = [part[index] for part in parts]
        return gather_by_dp(parts, self.grids)

    def update(self, method: str, batch: PolicyBatch, step: int) -> dict[str, float]:
        """An update (`update_actor` / `update_critic`) on each DP replica's rows; the metrics of
        DP replica 0 (they are reduced over DP inside the update)."""
        results = self.policy.call_each(method, self._by_rank([(part, step) for part in batch.split(self.dp_size)]))
        return next(r for g, r in zip(self.grids, results) if g["rank"] == 0)

    def _by_rank(self, per_dp: list[tuple]) -> list[tuple]:
        """Each rank gets its DP replica's arguments."""
        return [per_dp[g["dp_rank"]] for g in self.grids]

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in (self.rollout, self.policy):
            group.kill()
        remove_placement_group(self.placement)


def cluster_device(config: Config) -> str:
    """`trainer.device` resolved on the running Ray cluster ("cpu" or "cuda"); `ConfigError` for what the
    cluster cannot host (`validate` already refused what no cluster could)."""
    gpus = cluster_gpus()
    problems = cluster_problems(config, gpus)
    if problems:
        raise ConfigError(problems)
    return resolve_device(config.trainer.device, gpus)


def policy_spec(config: Config, plan: BatchPlan, total_steps: int) -> PolicyWorkerSpec:
    actor, critic = config.actor, config.critic
    critic_spec = None
    if critic.enable:
        critic_spec = CriticSpec(
            optim=settings.optim_settings(critic.optim, settings.total_optimizer_steps(plan, "critic", total_steps)),
            loss=settings.value_loss_settings(config),
            mini_batch_size=plan.critic.update.samples_per_rank,
            micro_batch_size=critic.micro_batch_size_per_gpu,
            ppo_epochs=critic.ppo_epochs,
        )
    return PolicyWorkerSpec(
        model_path=config.model.path,
        model_settings=ModelSettings(dtype=config.model.dtype, transformer_impl=config.model.transformer_impl),
        tp=actor.parallel.tensor_model_parallel_size,
        pp=actor.parallel.pipeline_model_parallel_size,
        seed=config.trainer.seed,
        optim=settings.optim_settings(actor.optim, settings.total_optimizer_steps(plan, "actor", total_steps)),
        recompute=settings.recompute_settings(actor.recompute),
        loss=settings.policy_loss_settings(config),
        mini_batch_size=plan.actor.update.samples_per_rank,
        micro_batch_size=actor.micro_batch_size_per_gpu,
        ppo_epochs=actor.ppo_epochs,
        use_reference=uses_reference(config),
        ref_micro_batch_size=config.ref.micro_batch_size_per_gpu,
        critic=critic_spec,
        reward_model_path=config.reward.reward_model,
        rollout_tp=config.rollout.tensor_model_parallel_size,
        bucket_mb=config.rollout.sync.bucket_mb,
    )


def device_bundles(config: Config, plan: BatchPlan) -> tuple[int, float]:
    """How many device bundles the job reserves and the CPU cores of one (colocated: room for both roles)."""
    colocated = config.placement.mode == "colocated"
    bundles = plan.train_gpus + (0 if colocated else plan.rollout_gpus)
    return bundles, 2.0 if colocated else 1.0


def role_bundle(bundle: BundleSpec, colocated: bool) -> BundleSpec:
    """What one rank process of a role takes of a device bundle: colocated, the policy and the rollout
    each take half of it (both on the same GPU); split, the whole of it."""
    return BundleSpec(cpus=1.0, gpus=bundle.gpus * (0.5 if colocated else 1.0))


def start_roles(config: Config, plan: BatchPlan, total_steps: int, env: dict[str, str], device: str) -> Roles:
    """Place and start both groups on `device` (`cluster_device`), then connect the weight sync (a
    process group of the trainer's sending ranks and every engine, or the shared transports' rings)."""
    colocated = config.placement.mode == "colocated"
    bundles, cpus = device_bundles(config, plan)
    bundle = BundleSpec(cpus=cpus, gpus=1.0 if device == "cuda" else 0.0)
    pg = create_placement_group("megarl", bundles, bundle)
    env = {**env, **worker_env(device)}
    role = role_bundle(bundle, colocated)
    policy = WorkerGroup("policy", POLICY_TARGET, plan.train_gpus, pg, role,
                         init_kwargs={"spec": policy_spec(config, plan, total_steps)}, env=env)
    rollout = config.rollout
    rollout_group = WorkerGroup(
        "rollout", ROLLOUT_TARGET, plan.rollout_engines, pg,
        BundleSpec(cpus=role.cpus, gpus=role.gpus * rollout.tensor_model_parallel_size),
        init_kwargs={
            "backend": rollout.backend, "model_path": config.model.path,
            "tensor_parallel_size": rollout.tensor_model_parallel_size, "dtype": config.model.dtype,
            "seed": rollout.seed, "max_model_len": config.data.max_prompt_length + rollout.max_new_tokens,
            "cpu_kv_cache_gib": max(1, math.ceil(rollout.kv_cache_gib)),
            "gpu_memory_utilization": rollout.gpu_memory_utilization,
        },
        env=env, first_bundle=0 if colocated else plan.train_gpus,
    )
    transport = sync_transport(rollout.sync.transport, device, policy.node_ids()[0], rollout_group.node_ids())
    per_rank = per_rank_sync(config, transport)
    roles = Roles(policy, rollout_group, policy.call_all("grid"), pg, transport, per_rank)
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
    workers form one process group (`shard_receive.receiver_rank`: engine k's workers at
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
