"""The batch plan: how one training step's prompts and samples are cut across engines, ranks and micro-batches.

    samples per step        = data.train_batch_size (prompts) × rollout.n
    rollout engines         = rollout GPUs ÷ rollout TP;  samples per engine = samples per step ÷ engines
    role DP                 = training GPUs ÷ (TP × PP)
    role processes          = the actor's, or a worker group of its own when its (TP, PP, EP, expert TP) differs
                              from the actor's (megatron-core keeps one grid per process) or ref.colocate_with_actor
                              is false
    role experts            = expert TP × EP × expert DP per pipeline stage (training GPUs ÷ PP)
    samples per mini-batch  = ppo_mini_batch_size (prompts) × rollout.n;  per rank = that ÷ DP
    grad accumulation       = per-rank mini-batch ÷ micro_batch_size_per_gpu (micro-batches per optimizer step);
                              packed by tokens (max_tokens_per_micro_batch, "auto" by default: the token slots
                              of a padded micro-batch, `megarl.config.token_budget`), as many packed
                              micro-batches as the tokens need
    optimizer steps / step  = (train_batch_size ÷ ppo_mini_batch_size) × ppo_epochs
    old log-probs           = the actor update's own forward when exactly on-policy (1 optimizer step, nothing
                              reads them before the update), else a forward pass of their own

Every division must be exact; a problem shows the arithmetic. The plan is derived, never written back.
"""

from dataclasses import dataclass

from megarl.config.config import Config
from megarl.config.problems import ConfigError, Problem
from megarl.config.role_checks import check_expert_grid, check_interleaved_micro_batches
from megarl.config.roles import ActorConfig, CriticConfig, ParallelConfig, RefConfig
from megarl.config.token_budget import sample_token_bound, token_budget


@dataclass(frozen=True)
class UpdatePlan:
    """How a trained role (actor, critic) slices one step's samples into optimizer steps."""

    mini_batch_prompts: int
    """Prompts per optimizer step (ppo_mini_batch_size)."""
    mini_batch_samples: int
    """Samples per optimizer step, all ranks together."""
    samples_per_rank: int
    """Samples per optimizer step on one DP rank."""
    grad_accumulation_steps: int | None
    """Micro-batches per rank per optimizer step; None when packed by tokens (the data decides)."""
    mini_batches_per_epoch: int
    """Optimizer steps per pass over the step's samples."""
    optimizer_steps_per_step: int
    """Optimizer steps per training step (mini-batches × ppo_epochs)."""


@dataclass(frozen=True)
class RolePlan:
    """One Megatron role's parallel layout and its forward pass over a step's samples."""

    role: str
    """actor, critic or ref."""
    tensor_parallel: int
    """TP size."""
    pipeline_parallel: int
    """PP size."""
    data_parallel: int
    """DP size = training GPUs ÷ (TP × PP)."""
    micro_batch_size: int
    """Samples per micro-batch on one rank (padded micro-batches)."""
    max_tokens_per_micro_batch: int | None
    """Token budget of packed micro-batches (the role's `max_tokens_per_micro_batch`, "auto" resolved:
    `megarl.config.token_budget`); None = padded."""
    samples_per_rank: int
    """Samples of one training step on one DP rank (log-prob / value pass)."""
    forward_micro_batches: int | None
    """Micro-batches per rank for that forward pass; None when packed by tokens (the data decides): by the
    role's `max_tokens_per_micro_batch`, or a trained role's `forward_max_tokens_per_micro_batch`."""
    update: UpdatePlan | None
    """Optimizer slicing; None for the reference, which never trains."""
    own_group: bool
    """Runs in a worker group of its own (one process per training GPU, its own grid, on the actor's
    GPUs) instead of inside the actor's processes."""
    sequence_parallel: bool
    """Megatron sequence parallelism over the TP ranks (the role's `parallel.sequence_parallel`)."""
    virtual_pipeline: int
    """Virtual stages (model chunks) per PP rank; 1 without the interleaved schedule
    (`parallel.virtual_pipeline_model_parallel_size`)."""
    expert_parallel: int = 1
    """EP size (the role's `parallel.expert_model_parallel_size`); 1 for a dense model."""
    expert_tensor_parallel: int = 1
    """Expert TP size (the role's `parallel.expert_tensor_parallel_size`, its TP when unset)."""
    context_parallel: int = 1
    """CP size (the role's `parallel.context_parallel_size`): ranks each sequence is split over."""

    @property
    def grid(self) -> tuple[int, int, int, int, int, int]:
        """(TP, PP, VPP, EP, expert TP, CP): what one process's megatron grid and model chunks are made of."""
        return (
            self.tensor_parallel,
            self.pipeline_parallel,
            self.virtual_pipeline,
            self.expert_parallel,
            self.expert_tensor_parallel,
            self.context_parallel,
        )


@dataclass(frozen=True)
class BatchPlan:
    """Derived sizes of one training step (`megarl validate` prints it)."""

    prompts_per_step: int
    """data.train_batch_size."""
    samples_per_prompt: int
    """rollout.n."""
    samples_per_step: int
    """Prompts × samples per prompt."""
    world_size: int
    """All GPUs (processes on CPU): nnodes × gpus_per_node."""
    train_gpus: int
    """GPUs of the Megatron roles (all of them when colocated)."""
    rollout_gpus: int
    """GPUs of the rollout engines (all of them when colocated)."""
    rollout_tp: int
    """Tensor-parallel size of one rollout engine."""
    rollout_engines: int
    """Rollout GPUs ÷ rollout TP."""
    samples_per_engine: int
    """Samples each engine generates per step."""
    actor: RolePlan
    """The actor's layout and slicing."""
    critic: RolePlan | None
    """The critic's, or None without a critic."""
    ref: RolePlan | None
    """The reference's, or None when no KL term needs it."""
    old_log_prob_pass: tuple[str, ...]
    """Why the actor's old log-probs need a forward pass of their own before the update (`old_log_prob_pass`);
    empty when the update is exactly on-policy and takes them, detached, from its own forward."""

    @property
    def own_groups(self) -> list[RolePlan]:
        """The roles that run in worker groups of their own."""
        return [role for role in (self.critic, self.ref) if role is not None and role.own_group]

    @property
    def colocated(self) -> bool:
        """The rollout engines share the training GPUs."""
        return self.train_gpus == self.world_size

    @property
    def processes_per_train_gpu(self) -> int:
        """Processes that share one training GPU: the actor's, one per role group of its own, and the
        rollout engine's when colocated."""
        return 1 + len(self.own_groups) + self.colocated


def uses_reference(config: Config) -> bool:
    """The reference model exists only when a KL term reads its log-probs."""
    return config.actor.use_kl_loss or config.algorithm.use_kl_in_reward


def old_log_prob_pass(config: Config, update: UpdatePlan) -> tuple[str, ...]:
    """Why the old log-probs need a forward pass before the actor update; empty when the update is exactly
    on-policy. One optimizer step over the whole batch runs on the weights that sampled it, so the
    update's own forward gives the old log-probs (ratio ≡ 1, as verl and TRL do); TIS reads them inside
    the loss, so it is served alike. Only a reuse of the batch or a reader before the update needs the pass."""
    reasons = []
    if update.optimizer_steps_per_step > 1:
        epochs = config.actor.ppo_epochs
        reasons.append(
            f"{update.mini_batches_per_epoch} mini-batch{'es' if update.mini_batches_per_epoch > 1 else ''}"
            f" × {epochs} epoch{'s' if epochs > 1 else ''}"
        )
    if config.algorithm.use_kl_in_reward:
        reasons.append("algorithm.use_kl_in_reward reads them before the update")
    if config.actor.moe.router_replay:
        reasons.append("actor.moe.router_replay measures the routers' own choice against the rollout's there")
    return tuple(reasons)


def runs_in_own_group(name: str, config: Config) -> bool:
    """Whether role `name` (critic, ref) needs a worker group of its own: megatron-core keeps one
    (TP, PP, EP, expert TP) grid per process, so a layout other than the actor's needs other processes;
    the reference also gets its own when `ref.colocate_with_actor` is false."""
    role = getattr(config, name)
    return grid_of(role.parallel) != grid_of(config.actor.parallel) or (
        name == "ref" and not config.ref.colocate_with_actor
    )


def grid_of(parallel: ParallelConfig) -> tuple[int, int, int, int, int, int]:
    """(TP, PP, VPP, EP, expert TP, CP) of a `parallel` section, VPP and expert TP resolved (unset: 1 and TP)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    vpp, etp = parallel.virtual_pipeline_model_parallel_size, parallel.expert_tensor_parallel_size
    ep, cp = parallel.expert_model_parallel_size, parallel.context_parallel_size
    return tp, pp, vpp or 1, ep, tp if etp is None else etp, cp


def plan_batches(config: Config) -> BatchPlan:
    """The batch plan of `config`; raises `ConfigError` with every broken size or divisibility rule."""
    plan, problems = _plan(config)
    if problems or plan is None:
        raise ConfigError(problems)
    return plan


def batch_problems(config: Config) -> list[Problem]:
    """Every size and divisibility problem of `config` (what `plan_batches` would raise)."""
    return _plan(config)[1]


def _plan(config: Config) -> tuple[BatchPlan | None, list[Problem]]:
    problems: list[Problem] = []
    if not _sizes_positive(config, problems):
        return None, problems
    prompts, n = config.data.train_batch_size, config.rollout.n
    samples = prompts * n
    gpus = _placement(config, problems)
    if gpus is None:
        return None, problems
    world, train_gpus, rollout_gpus = gpus
    engines = _rollout_engines(config, rollout_gpus, samples, problems)
    actor = _role_plan("actor", config.actor, train_gpus, config, problems, trained=True)
    critic = (
        _role_plan("critic", config.critic, train_gpus, config, problems, trained=True)
        if config.critic.enable
        else None
    )
    ref = _role_plan("ref", config.ref, train_gpus, config, problems, trained=False) if uses_reference(config) else None
    if problems:
        return None, problems
    plan = BatchPlan(
        prompts,
        n,
        samples,
        world,
        train_gpus,
        rollout_gpus,
        config.rollout.tensor_model_parallel_size,
        engines,
        samples // engines,
        actor,
        critic,
        ref,
        old_log_prob_pass(config, actor.update),
    )
    return plan, problems


def _sizes_positive(config: Config, problems: list[Problem]) -> bool:
    sizes = {
        "data.train_batch_size": config.data.train_batch_size,
        "rollout.n": config.rollout.n,
        "rollout.tensor_model_parallel_size": config.rollout.tensor_model_parallel_size,
        "placement.nnodes": config.placement.nnodes,
        "placement.gpus_per_node": config.placement.gpus_per_node,
    }
    roles: dict[str, ActorConfig | CriticConfig | RefConfig] = {
        "actor": config.actor,
        "critic": config.critic,
        "ref": config.ref,
    }
    for name, role in roles.items():
        sizes[f"{name}.parallel.tensor_model_parallel_size"] = role.parallel.tensor_model_parallel_size
        sizes[f"{name}.parallel.pipeline_model_parallel_size"] = role.parallel.pipeline_model_parallel_size
        sizes[f"{name}.parallel.expert_model_parallel_size"] = role.parallel.expert_model_parallel_size
        sizes[f"{name}.parallel.context_parallel_size"] = role.parallel.context_parallel_size
        if role.parallel.expert_tensor_parallel_size is not None:
            sizes[f"{name}.parallel.expert_tensor_parallel_size"] = role.parallel.expert_tensor_parallel_size
        sizes[f"{name}.micro_batch_size_per_gpu"] = role.micro_batch_size_per_gpu
    # "auto" resolves to at least a whole sample (`token_budget`): only a number given can be too small.
    budgets = {
        f"{name}.max_tokens_per_micro_batch": role.max_tokens_per_micro_batch
        for name, role in roles.items()
        if isinstance(role.max_tokens_per_micro_batch, int)
    }
    for name, trained in (("actor", config.actor), ("critic", config.critic)):
        sizes[f"{name}.ppo_mini_batch_size"] = trained.ppo_mini_batch_size
        sizes[f"{name}.ppo_epochs"] = trained.ppo_epochs
        if trained.forward_max_tokens_per_micro_batch is not None:
            budgets[f"{name}.forward_max_tokens_per_micro_batch"] = trained.forward_max_tokens_per_micro_batch
    sizes |= budgets
    before = len(problems)
    for key, value in sizes.items():
        if value < 1:
            problems.append(Problem(key, value, "must be a positive integer", f"set {key} to 1 or more"))
    longest = sample_token_bound(config)
    for key, budget in budgets.items():
        if 1 <= budget < longest:
            problems.append(
                Problem(
                    key,
                    budget,
                    f"a sample may have {longest} tokens (data.max_prompt_length "
                    f"{config.data.max_prompt_length} + response {longest - config.data.max_prompt_length}) "
                    "and is never split across micro-batches",
                    f"set {key} to {longest} or more, or null for "
                    + (
                        "the update's cut"
                        if key.endswith(".forward_max_tokens_per_micro_batch")
                        else "padded micro-batches"
                    ),
                )
            )
    if config.placement.rollout_gpus < 0:
        problems.append(
            Problem(
                "placement.rollout_gpus",
                config.placement.rollout_gpus,
                "cannot be negative",
                "set it to 0 (colocated) or the number of rollout GPUs (split)",
            )
        )
    return len(problems) == before


def _placement(config: Config, problems: list[Problem]) -> tuple[int, int, int] | None:
    """(world size, training GPUs, rollout GPUs) of the placement."""
    placement = config.placement
    world = placement.nnodes * placement.gpus_per_node
    layout = f"{placement.nnodes} node(s) × {placement.gpus_per_node} GPUs = {world} GPUs"
    if placement.mode == "colocated":
        if placement.rollout_gpus != 0:
            problems.append(
                Problem(
                    "placement.rollout_gpus",
                    placement.rollout_gpus,
                    "colocated placement shares all GPUs, so rollout_gpus would be ignored",
                    "set placement.rollout_gpus=0, or placement.mode=split to give the rollout GPUs of its own",
                )
            )
            return None
        return world, world, world
    if not 1 <= placement.rollout_gpus < world:
        problems.append(
            Problem(
                "placement.rollout_gpus",
                placement.rollout_gpus,
                f"split placement needs between 1 and {world - 1} rollout GPUs ({layout}; the rest train)",
                f"set placement.rollout_gpus between 1 and {world - 1}",
            )
        )
        return None
    return world, world - placement.rollout_gpus, placement.rollout_gpus


def _rollout_engines(config: Config, rollout_gpus: int, samples: int, problems: list[Problem]) -> int:
    placement, tp = config.placement, config.rollout.tensor_model_parallel_size
    key = "rollout.tensor_model_parallel_size"
    where = "split rollout GPUs" if placement.mode == "split" else "GPUs"
    if rollout_gpus % tp:
        problems.append(
            Problem(
                key,
                tp,
                f"rollout TP {tp} does not divide the {rollout_gpus} {where} "
                f"({rollout_gpus} ÷ {tp} = {rollout_gpus / tp:.2f} engines)",
                f"use a rollout TP that divides {rollout_gpus}: {_divisors(rollout_gpus)}",
            )
        )
        return 0
    engines = rollout_gpus // tp
    first = placement.nnodes * placement.gpus_per_node - rollout_gpus
    straddling = _straddling_engine(first, engines, tp, placement.gpus_per_node)
    if straddling is not None:
        problems.append(_straddle_problem(config, first, straddling))
        return 0
    if samples % engines:
        problems.append(
            Problem(
                "data.train_batch_size",
                config.data.train_batch_size,
                f"{config.data.train_batch_size} prompts × {config.rollout.n} samples = {samples} samples do not split "
                f"evenly over {rollout_gpus} {where} ÷ rollout TP {tp} = {engines} engines "
                f"({samples} ÷ {engines} = {samples / engines:.2f})",
                f"make train_batch_size × rollout.n a multiple of {engines}",
            )
        )
    return engines


def _straddling_engine(first: int, engines: int, tp: int, per_node: int) -> int | None:
    """The first engine whose `tp` GPUs (engine k: GPUs first + k·tp ... first + (k+1)·tp − 1, nodes of
    `per_node` GPUs in order) lie on two nodes, or None: one engine's TP workers must share a node.

    Computed, not searched (a recipe may state millions of GPUs): only the engine holding the GPU before
    a node boundary can cross it, and it does unless the boundary is a whole number of engines past
    `first`. If the first boundary is and the second too, `per_node` is a multiple of `tp` and every
    boundary is."""
    first_boundary = (first // per_node + 1) * per_node
    for boundary in (first_boundary, first_boundary + per_node):
        engine = (boundary - 1 - first) // tp
        if engine >= engines:
            return None
        if (boundary - first) % tp:
            return engine
    return None


def _straddle_problem(config: Config, first: int, engine: int) -> Problem:
    placement, tp = config.placement, config.rollout.tensor_model_parallel_size
    per_node, key = placement.gpus_per_node, "rollout.tensor_model_parallel_size"
    fix = f"use a rollout TP that divides {per_node}: {_divisors(per_node)}"
    if placement.mode == "colocated":
        return Problem(
            key,
            tp,
            f"colocated engines must not straddle nodes: rollout TP {tp} does not divide the {per_node} GPUs of a node",
            fix,
        )
    start = first + engine * tp
    return Problem(
        key,
        tp,
        f"split engines must not straddle nodes: engine {engine} would span GPUs {start}–"
        f"{start + tp - 1} (the rollout has the last {placement.rollout_gpus} of "
        f"{placement.nnodes} node(s) × {per_node} GPUs), across two nodes",
        f"{fix}; or a placement.rollout_gpus that leaves a multiple of {tp} training GPUs (here {first})",
    )


def _role_plan(name: str, role, train_gpus: int, config: Config, problems: list[Problem], trained: bool):
    parallel: ParallelConfig = role.parallel
    tp, pp, cp = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.context_parallel_size,
    )
    model_parallel = tp * cp * pp
    sizes = f"TP {tp} × CP {cp} × PP {pp}" if cp > 1 else f"TP {tp} × PP {pp}"
    if train_gpus % model_parallel:
        problems.append(
            Problem(
                f"{name}.parallel.tensor_model_parallel_size",
                tp,
                f"{name} {sizes} = {model_parallel} does not divide the {train_gpus} training GPUs "
                f"({train_gpus} ÷ {model_parallel} = {train_gpus / model_parallel:.2f} data-parallel replicas)",
                f"choose sizes whose product divides {train_gpus}: {_divisors(train_gpus)}",
            )
        )
        return None
    dp = train_gpus // model_parallel
    if not check_expert_grid(f"{name}.", parallel, train_gpus, problems):
        return None
    _, _, _, ep, etp, _ = grid_of(parallel)
    own_group = name != "actor" and runs_in_own_group(name, config)
    dp_text = f"{name} DP {dp} ({train_gpus} GPUs ÷ ({sizes}))"
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    budget = token_budget(role, sample_token_bound(config))
    if trained:
        update = _update_plan(name, role, budget, dp, dp_text, config, problems)
        if update is None:
            return None
        if update.grad_accumulation_steps is not None:
            check_interleaved_micro_batches(
                f"{name}.micro_batch_size_per_gpu",
                role.micro_batch_size_per_gpu,
                parallel,
                update.grad_accumulation_steps,
                f"{update.samples_per_rank} samples per rank and mini-batch ÷ {role.micro_batch_size_per_gpu}",
                problems,
            )
        # A step is a whole number of mini-batches, each split exactly: the forward pass splits too.
        per_rank = update.samples_per_rank * update.mini_batches_per_epoch
        forward = (
            None if role.forward_max_tokens_per_micro_batch is not None else _micro_batches(per_rank, role, budget)
        )
        return RolePlan(
            name,
            tp,
            pp,
            dp,
            role.micro_batch_size_per_gpu,
            budget,
            per_rank,
            forward,
            update,
            own_group,
            parallel.sequence_parallel,
            vpp,
            ep,
            etp,
            cp,
        )
    prompts, n, micro = config.data.train_batch_size, config.rollout.n, role.micro_batch_size_per_gpu
    samples = prompts * n
    if samples % dp:
        problems.append(
            Problem(
                "data.train_batch_size",
                prompts,
                f"{prompts} prompts × {n} samples = {samples} samples do not split over {dp_text} "
                f"({samples} ÷ {dp} = {samples / dp:.2f})",
                f"make train_batch_size × rollout.n a multiple of {dp}",
            )
        )
        return None
    per_rank = samples // dp
    if per_rank % micro and budget is None:
        problems.append(
            Problem(
                f"{name}.micro_batch_size_per_gpu",
                micro,
                f"{samples} samples ÷ {dp_text} = {per_rank} per rank, not a multiple of {micro}",
                f"use a divisor of {per_rank}: {_divisors(per_rank)}",
            )
        )
        return None
    return RolePlan(
        name,
        tp,
        pp,
        dp,
        micro,
        budget,
        per_rank,
        _micro_batches(per_rank, role, budget),
        None,
        own_group,
        parallel.sequence_parallel,
        vpp,
        ep,
        etp,
        cp,
    )


def _micro_batches(samples: int, role, budget: int | None) -> int | None:
    """Padded micro-batches of `samples` samples; None when packed by tokens under `budget` (the data decides)."""
    return None if budget is not None else samples // role.micro_batch_size_per_gpu


def _update_plan(
    name: str, role, budget: int | None, dp: int, dp_text: str, config: Config, problems: list[Problem]
) -> UpdatePlan | None:
    prompts, n, micro = config.data.train_batch_size, config.rollout.n, role.micro_batch_size_per_gpu
    mini = role.ppo_mini_batch_size
    key = f"{name}.ppo_mini_batch_size"
    if prompts % mini:
        valid = [d for d in _divisor_list(prompts) if (d * n) % dp == 0]
        problems.append(
            Problem(
                key,
                mini,
                f"{prompts} prompts per step (data.train_batch_size) are not a whole "
                f"number of {mini}-prompt mini-batches ({prompts} ÷ {mini} = {prompts / mini:.2f})",
                f"use a divisor of {prompts} that also fits DP {dp}: {_short(valid)}",
            )
        )
        return None
    mini_samples = mini * n
    if mini_samples % dp:
        valid = [d for d in _divisor_list(prompts) if (d * n) % dp == 0]
        problems.append(
            Problem(
                key,
                mini,
                f"{mini} prompts × {n} samples = {mini_samples} samples per mini-batch do "
                f"not split over {dp_text}: {mini_samples} ÷ {dp} = {mini_samples / dp:.2f}",
                f"use a ppo_mini_batch_size with mini × {n} a multiple of {dp}: {_short(valid)}"
                if valid
                else f"change the {name} layout or rollout.n so that the DP size divides the samples",
            )
        )
        return None
    per_rank = mini_samples // dp
    if per_rank % micro and budget is None:
        problems.append(
            Problem(
                f"{name}.micro_batch_size_per_gpu",
                micro,
                f"{mini} prompts × {n} samples = {mini_samples} per mini-batch ÷ {dp_text} = {per_rank} "
                f"samples per rank, not a multiple of {micro}",
                f"use a divisor of {per_rank}: {_divisors(per_rank)}",
            )
        )
        return None
    batches = prompts // mini
    return UpdatePlan(
        mini, mini_samples, per_rank, _micro_batches(per_rank, role, budget), batches, batches * role.ppo_epochs
    )


DIVISOR_SEARCH = 100_000
"""The divisors offered as fixes are searched up to here: the hints show a few, and a recipe's size may be
far beyond what a search through all of them could finish."""


def _divisor_list(number: int) -> list[int]:
    """The divisors of `number` up to `DIVISOR_SEARCH`, ascending."""
    return [d for d in range(1, min(number, DIVISOR_SEARCH) + 1) if number % d == 0]


def _divisors(number: int) -> str:
    return _short(_divisor_list(number))


def _short(values: list[int]) -> str:
    if not values:
        return "none"
    return ", ".join(map(str, values)) if len(values) <= 8 else ", ".join(map(str, values[:8])) + ", ..."
