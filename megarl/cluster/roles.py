"""The processes of a run: a policy group (the actor and every role with its layout, one Megatron
world), a group per role with a layout of its own (`BatchPlan.own_groups`: its own processes, world
and grid), and a rollout group (one engine per worker), placed on Ray, with the weight-sync group
wired between the policy and the rollout.

Routing. `Roles.stage` stages a step's batch once on each group the step calls, cut by that group's
DP size, and sends each worker method to the group of its role (`megarl.cluster.staged_batch`:
`METHOD_ROLES`); later calls send only the fields new to the group.

Placement. One bundle per device (a GPU, or one CPU slot on a CPU machine). The policy group and
each role group of its own share the training bundles: one process each on every training bundle,
each with an equal share of its GPU and one CPU. Colocated: the rollout engines share those bundles
too; split: the rollout gets `placement.rollout_gpus` bundles of its own after the trainer's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megarl.bridge.ring_routes import RingRoutes, route_rings
from megarl.bridge.transports.shared_memory import remove_slot_files
from megarl.cluster.handover import offload_before_engines
from megarl.cluster.megatron_group import MegatronGroup
from megarl.cluster.ray_node import device_bundles
from megarl.cluster.staged_batch import StagedBatch
from megarl.cluster.sync_step import SYNC_TIMEOUT_S
from megarl.cluster.timing import PhaseTimer
from megarl.config.batch_plan import BatchPlan
from megarl.config.config import Config
from megarl.config.engine_compile import engines_eager
from megarl.config.engines import loads_per_rank
from megarl.config.placement import cluster_problems, resolve_device
from megarl.config.problems import ConfigError
from megarl.config.rollout import response_length, rollout_dtype
from megarl.config.token_budget import sample_token_bound, token_budget
from megarl.orchestration.cluster import cluster_gpus, driver_node_address
from megarl.orchestration.placement import (
    BundleSpec,
    PlacementError,
    create_placement_group,
    engine_bundles,
    gpu_slots,
    remove_placement_group,
)
from megarl.orchestration.worker_group import WorkerGroup
from megarl.parallel.device import worker_env
from megarl.trainer import settings
from megarl.workers.batch import PolicyBatch
from megarl.workers.checkpoint_files import part_dir, step_dir_name
from megarl.workers.profiling import ProfileRequest
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.rollout.executor import engine_env, engine_holds_gpu
from megarl.workers.settings import ActorSpec, CriticSpec, PolicyWorkerSpec

ROLLOUT_TARGET = "megarl.workers.rollout.rollout_worker:RolloutWorker"
ENGINE_SHUTDOWN_TIMEOUT_S = 60.0
"""How long the end of a run waits for the rollout engines to stop their worker processes (vLLM gives a
TP worker `VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`, 30 s in megarl's engines, to exit, then 4 s after a
SIGTERM) before it kills them; an engine still generating when a stop signal came may use it up."""


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
    routes: RingRoutes | None
    """The shared transports' rings: which trainer rank's ring each engine worker reads, carrying
    what (`megarl.bridge.ring_routes`; `rollout.sync.per_rank` resolved); None for the collective."""
    packed_roles: frozenset[str] = frozenset()
    """Roles with packed micro-batches (`packs_by_tokens`): the DP ranks of their groups
    get rows balanced by tokens, since a packed rank's time follows its tokens, not its rows."""

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

    def stage(
        self, batch: PolicyBatch, profile: ProfileRequest | None = None, updates: Sequence[str] = ()
    ) -> StagedBatch:
        """The step's `batch`, to be staged once on each group the step calls (`megarl.cluster.staged_batch`),
        with the step's `profile` request; `updates`: the update methods the step runs, in order (each
        group drops its rows with its last); use it as a context manager: the other groups drop theirs at its end."""
        return StagedBatch(self.groups, batch, self.packed_roles, profile, updates)

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

    def _distinct_groups(self) -> list[MegatronGroup]:
        return list({id(group): group for group in self.groups.values()}.values())

    def _own_trained(self) -> dict[str, MegatronGroup]:
        """Groups of their own whose role has state to checkpoint (the reference is the initial model)."""
        return {role: group for role, group in self.own_groups.items() if role != "ref"}

    def shutdown(self) -> None:
        """Stop the engines (their clean-up runs), kill the Megatron ranks, and remove the weight-sync slot
        files of those on this node: a rank killed with a sync's slots open (a stop between the rings'
        opening and the send that closes them, or a failure mid-send) cannot remove its own."""
        self.rollout.shutdown(ENGINE_SHUTDOWN_TIMEOUT_S)
        here = driver_node_address()
        killed = set()
        for group in self._distinct_groups():
            group.workers.kill()
            killed |= {pid for pid, node in zip(group.workers.pids, group.workers.nodes) if node == here}
        remove_slot_files(killed.__contains__)
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
    critic = critic_spec(config, plan, total_steps) if plan.critic else None
    policy = PolicyWorkerSpec(
        model_path=config.model.path,
        model=config.model,
        tp=plan.actor.tensor_parallel,
        pp=plan.actor.pipeline_parallel,
        vpp=plan.actor.virtual_pipeline,
        ep=plan.actor.expert_parallel,
        etp=plan.actor.expert_tensor_parallel,
        cp=plan.actor.context_parallel,
        seed=config.trainer.seed,
        actor=actor_spec(config, plan, total_steps),
        use_reference=plan.ref is not None and "ref" not in own,
        ref_micro_batch_size=config.ref.micro_batch_size_per_gpu,
        ref_micro_batch=settings.micro_batch_cut(config.ref, "ref", config),
        ref_offload=config.ref.offload_params,
        critic=None if "critic" in own else critic,
        ref_sequence_parallel=config.ref.parallel.sequence_parallel,
        ref_router_replay=config.actor.moe.router_replay,
        reward_model_path=config.reward.reward_model,
    )
    specs = {"policy": policy}
    for role in plan.own_groups:
        specs[role.role] = PolicyWorkerSpec(
            model_path=config.model.path,
            model=config.model,
            tp=role.tensor_parallel,
            pp=role.pipeline_parallel,
            vpp=role.virtual_pipeline,
            ep=role.expert_parallel,
            etp=role.expert_tensor_parallel,
            cp=role.context_parallel,
            seed=config.trainer.seed,
            actor=None,
            use_reference=role.role == "ref",
            ref_micro_batch_size=config.ref.micro_batch_size_per_gpu,
            ref_micro_batch=settings.micro_batch_cut(config.ref, "ref", config),
            ref_offload=config.ref.offload_params,
            critic=critic if role.role == "critic" else None,
            ref_sequence_parallel=config.ref.parallel.sequence_parallel,
            ref_router_replay=config.actor.moe.router_replay,
            reward_model_path=None,
        )
    return specs


def packs_by_tokens(role_config, config: Config) -> bool:
    """Whether a role (its section `role_config` of `config`) packs any of its passes by tokens: its
    update's budget ("auto" resolved) or its forward pass's (the reference has only the one)."""
    forward = getattr(role_config, "forward_max_tokens_per_micro_batch", None)
    return token_budget(role_config, sample_token_bound(config)) is not None or forward is not None


def actor_spec(config: Config, plan: BatchPlan, total_steps: int) -> ActorSpec:
    return ActorSpec(
        section=config.actor,
        lr_decay_steps=settings.total_optimizer_steps(plan, "actor", total_steps),
        mini_batch_size=plan.actor.update.samples_per_rank,
        micro_batch_size=settings.micro_batch_cut(config.actor, "actor", config),
        forward_micro_batch=settings.forward_micro_batch_cut(config.actor, "actor", config),
        rollout_tp=config.rollout.tensor_model_parallel_size,
        rollout_expert_parallel=config.rollout.expert_parallel,
        rollout_dtype=rollout_dtype(config.rollout, config.model.dtype),
        bucket_mb=config.rollout.sync.bucket_mb,
    )


def critic_spec(config: Config, plan: BatchPlan, total_steps: int) -> CriticSpec:
    return CriticSpec(
        section=config.critic,
        lr_decay_steps=settings.total_optimizer_steps(plan, "critic", total_steps),
        mini_batch_size=plan.critic.update.samples_per_rank,
        micro_batch_size=settings.micro_batch_cut(config.critic, "critic", config),
        forward_micro_batch=settings.forward_micro_batch_cut(config.critic, "critic", config),
    )


def process_share(bundle: BundleSpec, processes: int) -> BundleSpec:
    """What one of the `processes` that share a device bundle takes of it: one CPU and an equal share
    of its GPU (colocated, every Megatron group's rank and the engine sit on the same GPU)."""
    return BundleSpec(cpus=1.0, gpus=bundle.gpus / processes)


def start_roles(
    config: Config, plan: BatchPlan, total_steps: int, env: dict[str, str], device: str, startup: PhaseTimer
) -> Roles:
    """Place and start the Megatron groups and the rollout group on `device` (`cluster_device`), then
    connect the weight sync (a process group of the trainer's sending ranks and every engine, or the
    shared transports' rings); each part timed by `startup` (`timing.STARTUP_PHASES`)."""
    bundles, cpus = device_bundles(plan)
    bundle = BundleSpec(cpus=cpus, gpus=1.0 if device == "cuda" else 0.0)
    pg = create_placement_group("megarl", bundles, bundle)
    # Slots (`placement` module docstring): an engine's TP rank r computes on the GPU of its slot's trainer rank.
    slots = gpu_slots(pg, bundles) if device == "cuda" else list(range(bundles))
    env = {**env, **worker_env(device)}
    share = process_share(bundle, plan.processes_per_train_gpu)
    with startup("megatron"):
        started = {
            name: MegatronGroup.start(
                name,
                spec,
                plan.train_gpus,
                pg,
                share,
                env,
                hang_timeout_s=config.trainer.hang_timeout_s,
                bundles=slots[: plan.train_gpus],
            )
            for name, spec in worker_specs(config, plan, total_steps).items()
        }
        offload_before_engines(started.values(), config.rollout.gpu_memory_utilization)
    groups = {
        role.role: started[role.role if role.own_group else "policy"]
        for role in (plan.actor, plan.critic, plan.ref)
        if role is not None
    }
    with startup("engines"):
        eager = engines_eager(config, plan, total_steps, device).eager
        rollout_group = start_rollout(
            config, plan, pg, slots, share.gpus if plan.colocated else bundle.gpus, env, eager
        )
    try:
        return _connect(config, plan, device, startup, groups, rollout_group, pg)
    except BaseException:
        # The run has no `Roles` to shut down yet: the engines' own clean-up still runs (their TP workers'
        # shared memory, issue 36); the Megatron ranks go with Ray.
        rollout_group.shutdown(ENGINE_SHUTDOWN_TIMEOUT_S)
        raise


def _connect(
    config: Config, plan: BatchPlan, device: str, startup: PhaseTimer, groups: dict, rollout_group: WorkerGroup, pg
) -> Roles:
    """The started groups as `Roles`, with the weight sync between them connected."""
    rollout = config.rollout
    policy = groups["actor"].workers
    # Split experts reach the engines through the rings only as the schedule's pieces, which need the per-rank load.
    collective_only = experts_split(config) and not loads_per_rank(config.rollout)
    routes = None if collective_only else shared_routes(config, plan, weight_sync_grids(groups["actor"].grids))
    policy_nodes = policy.node_ids()
    ring_nodes = (
        [] if routes is None else [policy_nodes[rank] for rank, readers in enumerate(routes.readers) if readers]
    )
    transport = sync_transport(
        rollout.sync.transport, device, plan.colocated, ring_nodes, rollout_group.node_ids(), collective_only
    )
    routes = None if transport == "collective" else routes
    packed = frozenset(name for name in groups if packs_by_tokens(getattr(config, name), config))
    roles = Roles(groups, rollout_group, pg, transport, routes, packed)
    # The sync blocks each side on the other: a wait on either names a silent rank of the other (a cut-off node).
    policy.shares_collectives_with(rollout_group)
    rollout_group.shares_collectives_with(policy)
    with startup("weight_sync"):
        if routes is None:
            connect_weight_sync(roles, rollout.tensor_model_parallel_size)
        else:
            policy.call_all("use_shared_weight_sync", transport, routes, SYNC_TIMEOUT_S)
    return roles


def start_rollout(
    config: Config, plan: BatchPlan, pg, slots: list[int], gpus_per_device: float, env: dict[str, str], eager: bool
) -> WorkerGroup:
    """One `RolloutWorker` per engine, engine k on the `rollout.tensor_model_parallel_size` bundles
    `placement.engine_bundles` gives it from the run's `slots` (the training slots when colocated, the
    split rollout's after them), each worker taking `gpus_per_device` of a bundle's GPU. A TP 1 engine's process takes
    its bundle's share; a wider engine's process takes none and vLLM places its TP workers on the
    engine's bundles (`megarl.workers.rollout.executor`). `eager`: the run's `rollout.enforce_eager`, resolved
    (`megarl.config.engine_compile.engines_eager`)."""
    rollout, tp = config.rollout, config.rollout.tensor_model_parallel_size
    first = 0 if plan.colocated else plan.train_gpus
    bundles = engine_bundles(pg, slots, first, plan.rollout_engines, tp, config.placement.gpus_per_node)
    return WorkerGroup(
        "rollout",
        ROLLOUT_TARGET,
        plan.rollout_engines,
        pg,
        BundleSpec(cpus=1.0, gpus=gpus_per_device if engine_holds_gpu(tp) else 0.0),
        init_kwargs={"backend": rollout.backend, "args": engine_args(config, eager)},
        env=[{**env, **engine_env(indices, gpus_per_device)} for indices in bundles],
        hang_timeout_s=config.trainer.hang_timeout_s,
        bundles=[indices[0] for indices in bundles],
    )


def engine_args(config: Config, eager: bool) -> EngineArgs:
    """What every rollout engine of the run is started with; `eager` as `start_rollout`'s."""
    rollout = config.rollout
    return EngineArgs(
        model_path=config.model.path,
        tensor_parallel_size=rollout.tensor_model_parallel_size,
        dtype=rollout_dtype(rollout, config.model.dtype),
        seed=rollout.seed,
        max_model_len=config.data.max_prompt_length + response_length(rollout),
        cpu_kv_cache_gib=max(1, math.ceil(rollout.kv_cache_gib)),
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        enforce_eager=eager,
        sleep_level=rollout.sleep_level,
        return_routed_experts=config.actor.moe.router_replay,
        expert_parallel=rollout.expert_parallel,
    )


def experts_split(config: Config) -> bool:
    """Whether the actor or the engines place the experts otherwise than the dense weights (actor EP > 1,
    expert TP ≠ TP, `rollout.expert_parallel`): the collective's shard sync or the rings' schedule sends
    those (`bridge.LayoutPair.experts_split`), not a rank's own shards nor gathered buckets."""
    parallel = config.actor.parallel
    etp = parallel.expert_tensor_parallel_size
    return (
        parallel.expert_model_parallel_size > 1
        or etp not in (None, parallel.tensor_model_parallel_size)
        or config.rollout.expert_parallel
    )


def sync_transport(
    setting: str,
    device: str,
    colocated: bool,
    ring_nodes: list[str],
    engine_nodes: list[str],
    collective_only: bool = False,
) -> str:
    """`rollout.sync.transport` for this placement on `device`. A shared transport needs each engine
    worker on the node of the ring it reads: colocated, that of the trainer rank on its own bundle
    (`ring_routes`), always; split, the nodes of the ring-hosting trainer ranks (`ring_nodes`: rank 0,
    DP replica 0's TP ranks or the first rollout-TP ranks, by the routes) must all be the engines'
    one node. auto takes CUDA IPC for colocated GPUs (a
    collective there would put a trainer rank and an engine worker of one GPU in one NCCL group,
    which NCCL refuses: `placement_problems` refuses that setting), shared memory on CPU where it
    reaches, else the collective; the collective whenever only it carries the weights (`collective_only`:
    experts split, `experts_split`, without the per-rank load that takes the schedule's pieces from rings)."""
    reaches = colocated or len(set(engine_nodes) | set(ring_nodes)) == 1
    if setting == "auto" and collective_only:
        return "collective"
    if setting == "auto":
        if device == "cuda":
            return "cuda_ipc" if colocated else "collective"
        return "shared_memory" if reaches else "collective"
    if setting != "collective" and not reaches:
        raise PlacementError(
            f"rollout.sync.transport={setting}: split, the shared transports need every rollout engine on the node "
            f"of the trainer ranks whose rings they read, but Ray placed the engines and those ranks on "
            f"{len(set(engine_nodes) | set(ring_nodes))} nodes; use rollout.sync.transport: collective (or auto)"
        )
    return setting


def shared_routes(config: Config, plan: BatchPlan, grids: list[dict[str, int]]) -> RingRoutes:
    """The ring routes for the actor's `grids` (`route_rings`), with `rollout.sync.per_rank` resolved:
    the per-rank load needs the vLLM backend; each rank's own shards need actor TP == rollout TP (and
    PP 1 when colocated), other colocated layouts get the planner's pieces ("scheduled"); "always"
    where the routes do not stream each rank's own shards is an error (validation refuses the
    layouts, this the placement)."""
    setting = config.rollout.sync.per_rank
    routes = route_rings(
        grids,
        plan.rollout_engines,
        config.rollout.tensor_model_parallel_size,
        colocated=plan.colocated,
        per_rank=loads_per_rank(config.rollout),
        experts_split=experts_split(config),
    )
    if setting == "always" and not routes.per_rank:
        raise PlacementError(
            f"rollout.sync.per_rank=always: this placement's rings do not carry each rank's own shards ({routes.mode}: actor "
            f"TP {config.actor.parallel.tensor_model_parallel_size}, PP {config.actor.parallel.pipeline_model_parallel_size}, "
            f"rollout TP {config.rollout.tensor_model_parallel_size}, "
            f"placement.mode={config.placement.mode}); use rollout.sync.per_rank: auto"
        )
    return routes


def weight_sync_grids(grids: list[dict[str, int]]) -> list[dict[str, int]]:
    """The actor's `grids` as the weight sync sees them: `dp_rank` the rank's replica of the weights
    (`PolicyWorker.grid`'s `sync_replica`: with context parallelism each (DP, CP) pair is one, and only
    replica 0 sends; without, the DP rank)."""
    return [dict(grid, dp_rank=grid["sync_replica"]) for grid in grids]


def connect_weight_sync(roles: Roles, rollout_tp: int) -> None:
    """The trainer's sending ranks (DP replica 0's CP rank 0 and the first expert-DP replica's,
    `LayoutPair.senders`; global rank 0 hosts the store) and every engine's workers form one process group
    (`megarl.bridge.receiver_rank`: engine k's workers at senders + k·TP ...); the engines start joining
    first, then the trainer side completes it."""
    senders = roles.policy.call_rank0("sync_plan").layout.senders
    world = senders + roles.rollout.world_size * rollout_tp
    host, port = roles.policy.call_rank0("listen_weight_sync", world, SYNC_TIMEOUT_S)
    roles.rollout.call_each(
        "start_weight_sync",
        [(host, port, world, senders + k * rollout_tp, SYNC_TIMEOUT_S) for k in range(roles.rollout.world_size)],
    )
    roles.policy.call_all("connect_weight_sync", host, port, world, SYNC_TIMEOUT_S)
    roles.rollout.call_all("finish_weight_sync", SYNC_TIMEOUT_S)
