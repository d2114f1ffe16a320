"""The specs a worker rank is built from. A trained role's spec carries its config section once (`ActorSpec.section`
is the `actor` section, `CriticSpec.section` the `critic` one: optimizer, recompute, offload, loss fields,
epochs, layout) beside the numbers the batch plan derives from it and, for the actor, the rollout facts the
weight sync needs; the group's spec adds the `model` section. A knob of a section reaches the workers with no
field here. Plain values that import no megatron-core, so that the driver (`megarl.trainer`) starts without
loading it; the worker modules that use them (`megatron_train`, `actor`, `critic`, `policy_worker`,
`sft_worker`) import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.roles import ActorConfig, CriticConfig, OptimizerConfig
from megarl.config.sections import ModelConfig
from megarl.workers.packing import TokenBudget


@dataclass(frozen=True)
class CriticSpec:
    """The critic of a PPO run."""

    section: CriticConfig
    """The `critic` section: its `optim`, `recompute`, `offload`, `parallel.sequence_parallel`, `ppo_epochs`, and the
    `cliprange_value` and `loss_agg_mode` of the value loss."""
    lr_decay_steps: int
    """The critic's optimizer steps over the run (the batch plan's): the LR decay ends there."""
    mini_batch_size: int
    """Samples per optimizer step on one DP rank."""
    micro_batch_size: int | TokenBudget
    """Samples per forward/backward micro-batch (per GPU), or the budget of packed micro-batches."""
    forward_micro_batch: int | TokenBudget
    """The forward-only pass's cut (old log-probs, values): samples, or the budget of packed micro-batches."""


@dataclass(frozen=True)
class ActorSpec:
    """The policy being trained, and the sync of its weights into the rollout engines."""

    section: ActorConfig
    """The `actor` section: its `optim`, `recompute`, `offload`, `moe`, `parallel.sequence_parallel`, `ppo_epochs`,
    and the policy-loss fields of the objective (`megarl.workers.actor.PolicyLoss`)."""
    lr_decay_steps: int
    """The actor's optimizer steps over the run (the batch plan's): the LR decay ends there."""
    mini_batch_size: int
    """Actor samples per optimizer step on one DP rank."""
    micro_batch_size: int | TokenBudget
    """Samples per forward/backward micro-batch (per GPU), or the budget of packed micro-batches."""
    forward_micro_batch: int | TokenBudget
    """The forward-only pass's cut (old log-probs, values): samples, or the budget of packed micro-batches."""
    rollout_tp: int
    """Tensor-parallel size of each rollout engine (the bridge plan's target layout)."""
    rollout_expert_parallel: bool
    """The engines place whole experts over their TP ranks (`rollout.expert_parallel`, vLLM's expert parallelism)."""
    rollout_dtype: str
    """The engines' dtype (`rollout.dtype` resolved): the weights are cast to it on the way."""
    bucket_mb: float
    """Weight-sync bucket size."""


@dataclass(frozen=True)
class PolicyWorkerSpec:
    """The roles one rank hosts and its grid, in plain values (built from the config by the trainer)."""

    model_path: str
    """HF checkpoint dir the actor (and reference, critic backbone) start from."""
    model: ModelConfig
    """The `model` section: dtype and layer spec of every Megatron role (the checkpoint is `model_path`)."""
    tp: int
    """Tensor-parallel size of the grid (the layout of every hosted role)."""
    pp: int
    """Pipeline-parallel size of the grid."""
    vpp: int
    """Virtual pipeline stages per PP rank of the grid (1: none)."""
    ep: int
    """Expert-parallel size of the grid (1 for a dense model)."""
    etp: int
    """Expert tensor-parallel size of the grid (TP unless the role's `expert_tensor_parallel_size` says)."""
    seed: int
    actor: ActorSpec | None
    """The actor; None in the group of a role with a layout of its own."""
    use_reference: bool
    """Host the reference."""
    ref_micro_batch_size: int
    """Samples per forward micro-batch of the reward model (`ref.micro_batch_size_per_gpu`)."""
    ref_micro_batch: int | TokenBudget
    """The reference's forward micro-batches: samples, or the budget of packed micro-batches."""
    ref_offload: bool
    """Keep the reference's weights in host memory except during its log-prob pass (`ref.offload_params`)."""
    ref_sequence_parallel: bool
    """The reference with Megatron sequence parallelism over the TP ranks (`ref.parallel.sequence_parallel`)."""
    ref_router_replay: bool
    """The reference routes a batch's tokens through the rollout's experts, as the actor (`actor.moe.router_replay`)."""
    critic: CriticSpec | None
    reward_model_path: str | None
    """HF `*ForSequenceClassification` checkpoint scored beside the reward function (None = none)."""
    cp: int = 1
    """Context-parallel size of the grid (the role's `parallel.context_parallel_size`): ranks each sequence is
    split over."""


@dataclass(frozen=True)
class SftWorkerSpec:
    """What one SFT rank builds, in plain values (from `megarl.config.sft.SftConfig` by the driver)."""

    model_path: str
    """HF checkpoint dir to start from (its config.json and tokenizer files go into the export)."""
    model: ModelConfig
    """The `model` section: dtype and layer spec (the checkpoint is `model_path`)."""
    tp: int
    pp: int
    vpp: int
    """Virtual pipeline stages per PP rank (`parallel.virtual_pipeline_model_parallel_size`; 1: none)."""
    ep: int
    """Expert-parallel size (`parallel.expert_model_parallel_size`)."""
    etp: int
    """Expert tensor-parallel size (`parallel.expert_tensor_parallel_size`, TP when unset)."""
    cp: int
    """Context-parallel size (`parallel.context_parallel_size`): ranks each sequence is split over."""
    sequence_parallel: bool
    """Megatron sequence parallelism over the TP ranks (`parallel.sequence_parallel`)."""
    seed: int
    optim: OptimizerConfig
    """`optim`."""
    lr_decay_steps: int
    """Optimizer steps of the run: the LR decay ends there."""
    micro_batch_size: int
    """Conversations per forward/backward pass."""
