"""Sections of the three Megatron roles: `actor`, `critic` and `ref` (reference policy).

Batch sizes follow verl's conventions: `ppo_mini_batch_size` counts *prompts* across all data-parallel
ranks (each prompt brings `rollout.n` samples); `micro_batch_size_per_gpu` counts *samples* on one rank.
The data-parallel size is never set: it is derived (GPUs ÷ (TP × CP × PP)) and shown by `megarl validate`.
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron model parallelism of one role; data parallelism is what the GPUs leave over."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (TP). Must divide the attention heads and the KV groups of the model."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (PP). Must divide the number of transformer layers."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Virtual pipeline stages per PP rank (VPP, megatron's interleaved 1F1B schedule): the layers are cut
    into PP × VPP chunks dealt round-robin, rank r holding chunks r, r + PP, …, which shrinks the pipeline
    bubble VPP-fold for more point-to-point traffic. >= 2, with PP > 1 and PP × VPP dividing the layers; a
    padded update's micro-batches per rank and mini-batch must be a multiple of PP (megatron's schedule
    runs them in groups of PP). Same log-probs and updates as without. None: one chunk per rank."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: the activations outside attention and the MLP (norms, residuals,
    dropout) are split along the sequence over the TP ranks instead of replicated on each. Needs TP > 1;
    every micro-batch's sequence length is padded to a multiple of TP (`megarl.workers.micro_batches.
    pad_sequence`). Same log-probs and gradients as off, to float rounding."""
    context_parallel_size: int = 1
    """Context-parallel size (CP): each sequence is split over CP ranks (megatron's load-balanced layout: cut
    into 2 × CP chunks, rank r holding chunks r and 2·CP - 1 - r), with Transformer Engine's ring attention
    (`cp_comm_type` p2p) passing keys and values between them, so a rank holds the activations of 1/CP of
    every sequence. The CP ranks hold the same weights and take the same samples; data parallelism gets
    GPUs ÷ (TP × CP × PP), and gradients are reduced over DP × CP. Needs `model.transformer_impl:
    transformer_engine` (the THD micro-batches its CP attention takes; megatron's local spec has none), a
    dense model, and token budgets that are multiples of 2 × CP (× TP with sequence parallelism); every
    sample is padded to a multiple of 2 × CP tokens. Same log-probs and gradients as CP 1, to float
    rounding."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size (EP) of a mixture-of-experts model (Qwen3-MoE): each layer's experts are
    split over EP ranks, and tokens travel to their experts' ranks and back (megatron's alltoall
    dispatcher). Must divide the model's `num_experts`; 1 for a dense model. The experts have a grid of
    their own over the same ranks: expert TP × EP × expert DP on each pipeline stage, so expert TP × EP
    must divide the training GPUs ÷ PP (EP takes ranks from what would be DP for the experts)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size of each expert (ETP), when the experts are cut differently from the dense
    layers (e.g. 1: every expert whole on its rank, with TP > 1 for attention). null: the role's TP. Must
    divide the model's `moe_intermediate_size`; unset for a dense model."""


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam(W) through Megatron's optimizer, with warm-up then decay of the learning rate."""

    lr: float = 1.0e-6
    """Peak learning rate (after warm-up). > 0."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay, in [0, lr]. Unused with `lr_decay_style: constant`."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay. >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2), each in [0, 1)."""
    eps: float = 1.0e-8
    """Adam epsilon. > 0."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr`. >= 0."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay from `lr` to `min_lr` over the remaining optimizer steps."""
    clip_grad: float = 1.0
    """Global gradient-norm clip. 0 disables clipping."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1, Megatron's distributed optimizer)."""
    cpu_offload: bool = False
    """Keep the optimizer state (fp32 main parameters, Adam moments) of `cpu_offload_fraction` of the
    parameters in host memory and run their update on the CPU (megatron-core's HybridDeviceOptimizer):
    GPU memory for host memory and CPU time. Needs `use_distributed_optimizer` and `model.dtype:
    bfloat16`. Not with `offload.optimizer` (the offloaded state is in host memory already)."""
    cpu_offload_fraction: float = 1.0
    """With `cpu_offload`: the share of this rank's optimizer state (by parameter elements, in megatron's
    parameter order) kept on the host, in (0, 1]; the rest stays on the GPU."""


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recomputation (Megatron `recompute_granularity` / `_method` / `_num_layers`)."""

    granularity: Literal["none", "selective", "full"] = "none"
    """none: keep all activations; selective: recompute the attention core; full: recompute whole layers."""
    method: Literal["uniform", "block"] = "uniform"
    """With `full`: uniform recomputes every chunk of `num_layers` layers; block only the first `num_layers`."""
    num_layers: int | None = None
    """With `full`: layers per recomputed chunk (uniform) or per PP stage (block). Must be unset otherwise."""


@dataclass(frozen=True)
class OffloadConfig:
    """What the role moves off its GPUs while the colocated rollout engines generate, with megatron-core's
    offload APIs (`megarl.cluster.handover`). On CPU, where host memory is the device, only `grads` frees
    memory (params and optimizer would move host memory to host memory: nothing happens)."""

    params: bool = False
    """Move the parameters to host memory after the weight sync, back before the next step's log-probs."""
    grads: bool = False
    """Free the gradient buffers after the update (they are zeroed at the next one anyway); on CPU too."""
    optimizer: bool = False
    """Move the optimizer state (Adam moments, fp32 main parameters) to host memory after the update;
    bfloat16 parameters only (with float32 ones the optimizer updates the model's own parameters)."""


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance weights ρ = π_actor / π_rollout on the actor's token losses, from the actor's old
    log-probs (the proximal policy) and the engines' (the behaviour policy); no gradient flows through
    them (`megarl.algorithms.rollout_correction` has the formulas). The policy loss still clips
    π_θ / π_actor: `policy_loss: vanilla` with `level: token` is AReaL's decoupled PPO (its
    `behav_imp_weight_cap` is `mode: mask, high: cap`). The mismatch metrics (`mismatch/*`) are logged
    with or without a correction."""

    level: Literal["none", "token", "sequence", "geometric"] = "none"
    """What ρ is: per token (`token`), the product of a sequence's token ratios (`sequence`), or their
    geometric mean (`geometric`), the same for every token of a sequence. `none`: no correction."""
    mode: Literal["truncate", "mask"] = "truncate"
    """Ratios above `high`: capped there (`truncate`, TIS), or, with ratios below `low`, their tokens'
    losses masked (`mask`, masked IS / IcePop: weight ρ inside [low, high], 0 outside; a masked token
    stays in the loss normaliser)."""
    low: float = 0.0
    """`mask` only: ratios below it are masked (0: no lower bound). In [0, 1]."""
    high: float = 2.0
    """`truncate`: the cap on ρ; `mask`: ratios above it are masked. >= 1."""


@dataclass(frozen=True)
class MoeConfig:
    """Training settings of a mixture-of-experts model's routers (megatron-core's MoE losses); a dense
    model must leave them unset."""

    aux_loss_coeff: float | None = None
    """Weight of the load-balancing auxiliary loss (megatron's `moe_aux_loss_coeff`, Switch-style:
    experts' token shares × their mean routing scores, per layer and micro-batch). null: the
    checkpoint's `router_aux_loss_coef` (0.001 for Qwen3-MoE). 0 turns it off. >= 0."""
    z_loss_coeff: float | None = None
    """Weight of the router z-loss (ST-MoE: the squared log-sum-exp of the router logits, which keeps
    them small; megatron's `moe_z_loss_coeff`). null: off. > 0."""
    router_replay: bool = False
    """Rollout routing replay (R3): the rollout engines return the experts each token was routed to, and
    the actor's old-log-prob, reference and update passes route every token through exactly those experts
    (megatron-core's RouterReplay; the router's gate weights over them stay trained). It keeps the trainer's
    log-probs those of the function that sampled the tokens, where the engine's and the trainer's routers
    would otherwise pick different experts on near ties (GRPO on MoE models collapses without it:
    Megatron-LM#4168). The old-log-prob pass then runs twice, once with the routers' own choice, to log
    `actor/moe/routing_agreement` and the log-prob gap to the engines with and without replay. Single-turn,
    non-partial rollouts; the vLLM engines need its Model Runner V2 (Triton; on CPU triton-cpu) to return
    the routing. false: each pass routes by its own routers."""


@dataclass(frozen=True)
class ActorConfig:
    """The policy being trained: its layout, batch slicing, optimizer and policy loss."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline parallel layout of the actor."""
    micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward pass on one rank (training and log-prob passes)."""
    max_tokens_per_micro_batch: int | Literal["auto"] | None = "auto"
    """For the update and the log-prob pass: pack samples (prompt + response, no padding between them) into
    micro-batches of at most this many tokens per rank (rows no wider than the padded batch) instead
    of `micro_batch_size_per_gpu` padded samples; the losses and gradients are the same for any cut.
    At least data.max_prompt_length + the response length (a sample is never split). auto:
    micro_batch_size_per_gpu × (data.max_prompt_length + the response length), the token slots of a padded
    micro-batch (its peak memory, fewer padded tokens; padded where context parallelism cannot cut that
    budget: megarl.config.token_budget). null: padded micro-batches of `micro_batch_size_per_gpu` samples."""
    forward_max_tokens_per_micro_batch: int | None = None
    """For the log-prob pass (the old log-probs) only: packed micro-batches of at most this many tokens per
    rank, a budget of its own. A forward-only pass keeps no activations for a backward, so it takes a
    larger one than the update (verl's `log_prob_max_token_len_per_gpu`). At least data.max_prompt_length
    + the response length. None: the update's cut (`max_tokens_per_micro_batch`)."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step, across all DP ranks (× rollout.n samples). Must divide data.train_batch_size."""
    ppo_epochs: int = 1
    """Passes over each step's samples. >= 1."""
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    policy_loss: str = "vanilla"
    """Policy loss by its registry name (megarl.algorithms); `vanilla` is PPO's clipped surrogate."""
    clip_ratio_low: float = 0.2
    """PPO lower clip: the ratio is clipped at 1 - clip_ratio_low. In (0, 1)."""
    clip_ratio_high: float = 0.2
    """PPO upper clip: the ratio is clipped at 1 + clip_ratio_high (DAPO's clip-higher raises it). > 0."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (the loss is capped at clip_ratio_c × |A|). > 1."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number (megarl.algorithms LOSS_AGG_MODES: token-mean,
    seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm); the normalizer is global to the step."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss). >= 0."""
    use_kl_loss: bool = False
    """Add a KL(actor ‖ reference) term to the loss (GRPO style); needs the reference model."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss term. >= 0."""
    kl_loss_type: str = "k3"
    """KL estimator of the loss term, by megarl.algorithms KL_ESTIMATORS name (k1, abs, k2, k3 = low_var_kl)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy correction for the gap between the engines that sampled and the actor (bf16 engines,
    stale weights of an off-policy mode): truncated or masked importance weights, AReaL's decoupled PPO."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recomputation."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Host offload while the rollout runs."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Router losses of a mixture-of-experts model (load balancing, z-loss)."""


@dataclass(frozen=True)
class CriticConfig:
    """The value model (the policy's architecture with a scalar head); only GAE uses one."""

    enable: bool = False
    """Build and train a critic. Required by `algorithm.adv_estimator: gae`, refused by critic-free estimators."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline parallel layout of the critic. The actor's layout: the critic runs in the actor's
    processes; another layout: in a worker group of its own on the same GPUs (its own grid and DP)."""
    micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward pass on one rank."""
    max_tokens_per_micro_batch: int | Literal["auto"] | None = "auto"
    """For the update and the value pass: pack samples (prompt + response, no padding between them) into
    micro-batches of at most this many tokens per rank (rows no wider than the padded batch) instead
    of `micro_batch_size_per_gpu` padded samples; the losses and gradients are the same for any cut.
    At least data.max_prompt_length + the response length (a sample is never split). auto:
    micro_batch_size_per_gpu × (data.max_prompt_length + the response length), the token slots of a padded
    micro-batch (its peak memory, fewer padded tokens; padded where context parallelism cannot cut that
    budget: megarl.config.token_budget). null: padded micro-batches of `micro_batch_size_per_gpu` samples."""
    forward_max_tokens_per_micro_batch: int | None = None
    """For the value pass (the rollout-time values) only: packed micro-batches of at most this many tokens
    per rank, a budget of its own (as `actor.forward_max_tokens_per_micro_batch`). None: the update's cut."""
    ppo_mini_batch_size: int = 256
    """Prompts per critic optimizer step, across all DP ranks (× rollout.n samples)."""
    ppo_epochs: int = 1
    """Passes over each step's samples. >= 1."""
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1.0e-5))
    """Optimizer and learning-rate schedule."""
    cliprange_value: float = 0.5
    """Value clipping: new values stay within ± cliprange_value of the old ones. > 0."""
    loss_agg_mode: str = "token-mean"
    """How per-token value losses become one number (megarl.algorithms LOSS_AGG_MODES)."""
    warmup_steps: int = 0
    """Training steps at the start in which only the critic is updated (the actor waits). >= 0."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recomputation."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Host offload while the rollout runs."""


@dataclass(frozen=True)
class RefConfig:
    """The frozen reference policy; it exists only when a KL term is used (actor loss or reward)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline parallel layout of the reference. A layout other than the actor's runs in a worker
    group of its own on the same GPUs (its own grid and DP), whatever `colocate_with_actor` says."""
    micro_batch_size_per_gpu: int = 8
    """Samples per forward pass on one rank (log-probs only; the reward model's too)."""
    max_tokens_per_micro_batch: int | Literal["auto"] | None = "auto"
    """For the log-prob pass (not the reward model's): pack samples (prompt + response, no padding between them) into
    micro-batches of at most this many tokens per rank (rows no wider than the padded batch) instead
    of `micro_batch_size_per_gpu` padded samples; the log-probs are the same for any cut.
    At least data.max_prompt_length + the response length (a sample is never split). auto: the token slots
    of a padded micro-batch, null: padded micro-batches (as `actor.max_tokens_per_micro_batch`)."""
    colocate_with_actor: bool = True
    """With the actor's layout, run the reference inside the actor's processes (no extra processes);
    false: in a worker group of its own on the same GPUs."""
    offload_params: bool = False
    """Offload the parameters to host memory between log-prob passes."""
