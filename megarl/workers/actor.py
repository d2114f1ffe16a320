"""The policy: token log-probs and PPO-family updates of a megatron-core GPTModel over (TP, PP, DP).

    groups = initialize_model_parallel(tp=2, pp=2, seed=0)
    actor = MegatronActor.from_hf("/ckpt/tiny", groups, optim=OptimizerConfig(lr=1e-5), model=config.model)
    old_log_probs, entropy = actor.compute_log_prob(batch, micro_batch_size=8)
    metrics = actor.update_policy(batch, PolicyLoss(ActorConfig()),
                                  mini_batch_size=16, micro_batch_size=4)
    # or micro-batches packed under a token budget (`megarl.workers.packing`), no padding computed:
    budget = TokenBudget(2048, "actor.max_tokens_per_micro_batch")
    metrics = actor.update_policy(batch, loss, mini_batch_size=16, micro_batch_size=budget)

Every rank of a DP replica calls each method with the same `PolicyBatch` (that replica's samples);
results are returned on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from megarl.algorithms.kl import compute_kl_loss
from megarl.algorithms.losses import LOSS_AGG_MODES, agg_loss
from megarl.algorithms.policy_loss import POLICY_LOSSES, compute_policy_loss
from megarl.algorithms.rollout_correction import (
    MISMATCH_METRICS,
    RolloutCorrection,
    correction_metrics,
    correction_weights,
    mismatch_metrics,
)
from megarl.config.roles import (
    ActorConfig,
    MoeConfig,
    OffloadConfig,
    OptimizerConfig,
    RecomputeConfig,
    RolloutCorrectionConfig,
)
from megarl.config.sections import ModelConfig
from megarl.models.checkpoint import chunk_layer_offset
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.batch import PolicyBatch, mini_batches
from megarl.workers.logprobs import vocab_parallel_log_probs
from megarl.workers.megatron_train import (
    StepCounts,
    all_reduce,
    check_divides,
    compute_device,
    forward_collect,
    load_model,
    micro_batches_of,
    run_model,
    summarize_steps,
)
from megarl.workers.micro_batches import MicroBatch
from megarl.workers.moe_metrics import RouterLoad, clear_router_losses
from megarl.workers.packing import TokenBudget
from megarl.workers.router_replay import ExpertRouting
from megarl.workers.trained_model import TrainedModel


class PolicyLossFn(Protocol):
    """A policy objective for `MegatronActor.update_policy`."""

    loss_agg_mode: str
    """Which count normalises the step loss (see `megarl.algorithms.losses.LOSS_AGG_MODES`)."""
    metric_names: tuple[str, ...]
    """Keys of the metrics dict `__call__` returns."""
    required_fields: tuple[str, ...]
    """`PolicyBatch` fields the loss reads (checked before the update starts) besides `old_log_probs`,
    which `update_policy` always supplies: the batch's, or the update's own when exactly on-policy."""

    def __call__(
        self, log_probs: Tensor, entropy: Tensor, batch: PolicyBatch, counts: StepCounts
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`log_probs`, `entropy`: `[b, R]` of micro-batch `batch` under the current policy.

        Returns the micro-batch's share of the step loss (divided by `counts.normalizer`) and
        metrics as shares of their step values: each sums over micro-batches and DP ranks (a token
        mean is a masked sum divided by `counts.tokens`).
        """


CORRECTION_METRICS = ("correction_weight_mean", "correction_out_of_range_tokens", "correction_out_of_range_seqs")
"""The correction's metrics (`megarl.algorithms.rollout_correction.correction_metrics`) as `PolicyLoss` reports them."""


class PolicyLoss:
    """`PolicyLossFn` of the `actor` section (`policy_loss`, the clip ratios, `loss_agg_mode`,
    `entropy_coeff`, the KL loss when `use_kl_loss`, `rollout_correction`), built on megarl.algorithms.
    With `report_mismatch` it also reports `MISMATCH_METRICS` (engines vs the actor's old log-probs;
    the trainer always asks: the engines always report log-probs), with a correction
    `CORRECTION_METRICS`: step token / sequence means, like the clip fractions."""

    metric_names = ("pg_loss", "kl_loss", "clip_frac", "clip_frac_lower", "approx_kl")

    def __init__(self, actor: ActorConfig, *, report_mismatch: bool = False):
        if actor.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"actor.policy_loss={actor.policy_loss!r} is not one of {sorted(POLICY_LOSSES)}; pick one of them"
            )
        if actor.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"actor.loss_agg_mode={actor.loss_agg_mode!r} is not one of {LOSS_AGG_MODES}; pick one of them"
            )
        self.actor = actor
        self.loss_agg_mode = actor.loss_agg_mode
        self.kl_loss_coef = actor.kl_loss_coef if actor.use_kl_loss else 0.0
        self.correction = rollout_correction(actor.rollout_correction)
        self.report_mismatch = report_mismatch
        corrected = self.correction is not None
        self.required_fields = (
            ("advantages",)
            + (("rollout_log_probs",) if corrected or report_mismatch else ())
            + (("ref_log_probs",) if self.kl_loss_coef else ())
        )
        self.metric_names = (
            self.metric_names
            + (MISMATCH_METRICS if report_mismatch else ())
            + (CORRECTION_METRICS if corrected else ())
        )

    def __call__(self, log_probs, entropy, batch, counts):
        s = self.actor
        mask = batch.response_mask
        aggregation = dict(global_normalizer=counts.normalizer)
        # Step shares (sums over the step's tokens / sequences): they add up over micro-batches and ranks.
        shares = dict(tokens=counts.tokens, sequences=counts.sequences)
        metrics = {}
        if self.report_mismatch:
            metrics |= mismatch_metrics(batch.old_log_probs, batch.rollout_log_probs, mask, **shares)
        weights = None
        if self.correction is not None:
            correction = correction_weights(batch.old_log_probs, batch.rollout_log_probs, mask, self.correction)
            weights = correction.weights
            metrics |= {
                f"correction_{name}": value for name, value in correction_metrics(correction, mask, **shares).items()
            }
        policy = compute_policy_loss(
            s.policy_loss,
            batch.old_log_probs,
            log_probs,
            batch.advantages,
            mask,
            clip_ratio_low=s.clip_ratio_low,
            clip_ratio_high=s.clip_ratio_high,
            clip_ratio_c=s.clip_ratio_c,
            loss_agg_mode=s.loss_agg_mode,
            importance_weights=weights,
            **aggregation,
        )
        loss = policy.loss
        if s.entropy_coeff:
            loss = loss - s.entropy_coeff * agg_loss(entropy, mask, s.loss_agg_mode, **aggregation)
        kl_loss = log_probs.new_zeros(())
        if self.kl_loss_coef:
            kl_loss = compute_kl_loss(
                log_probs, batch.ref_log_probs, mask, s.kl_loss_type, s.loss_agg_mode, **aggregation
            )
            loss = loss + self.kl_loss_coef * kl_loss
        # compute_policy_loss reports micro-batch token means; weight them into step token means.
        token_share = mask.sum() / counts.tokens
        metrics |= dict(
            pg_loss=policy.loss.detach(),
            kl_loss=kl_loss.detach(),
            clip_frac=policy.clip_frac * token_share,
            clip_frac_lower=policy.clip_frac_lower * token_share,
            approx_kl=policy.approx_kl * token_share,
        )
        return loss, metrics


def rollout_correction(section: RolloutCorrectionConfig) -> RolloutCorrection | None:
    """The correction `actor.rollout_correction` asks for, as megarl.algorithms takes it; None for `level: none`."""
    if section.level == "none":
        return None
    return RolloutCorrection(level=section.level, mode=section.mode, low=section.low, high=section.high)


class MegatronActor(TrainedModel):
    """The policy model of this rank (its TP × PP shard), trained with Megatron DDP and optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        groups: ProcessGroups,
        *,
        vocab_size: int,
        optim: OptimizerConfig,
        lr_decay_steps: int | None = None,
        offload: OffloadConfig = OffloadConfig(),
    ):
        """`model`: this rank's megatron `GPTModel` (weights loaded); `vocab_size`: the real (HF)
        vocabulary size, the output layer's padding beyond it is ignored."""
        self.vocab_size = vocab_size
        super().__init__(model, groups, optim, lr_decay_steps, offload)
        self.router_load = RouterLoad(model, groups)
        """Tokens per expert of a mixture-of-experts model's routers during updates (`moe_metrics`)."""
        self.routing_metrics: dict[str, float] = {}
        """What the last log-prob pass of a batch with routed experts measured (`compute_log_prob`), until
        the next update reports it."""

    @classmethod
    def from_hf(
        cls,
        model_dir: str | Path,
        groups: ProcessGroups,
        *,
        optim: OptimizerConfig,
        lr_decay_steps: int | None = None,
        model: ModelConfig,
        recompute: RecomputeConfig = RecomputeConfig(),
        offload: OffloadConfig = OffloadConfig(),
        sequence_parallel: bool = False,
        moe: MoeConfig = MoeConfig(),
    ) -> MegatronActor:
        """Build this rank's shard from an HF checkpoint dir and load its weights; `sequence_parallel`:
        megatron's sequence parallelism over the TP ranks (`actor.parallel.sequence_parallel`); `moe`:
        a mixture-of-experts model's router losses (`actor.moe`); `optim`, `lr_decay_steps` as
        `megarl.workers.megatron_train.TrainEngine`'s."""
        model, vocab_size = load_model(
            model_dir,
            groups,
            model=model,
            recompute=recompute,
            value_head=False,
            sequence_parallel=sequence_parallel,
            moe=moe,
        )
        return cls(model, groups, vocab_size=vocab_size, optim=optim, lr_decay_steps=lr_decay_steps, offload=offload)

    @property
    def router_replay(self) -> bool:
        """The forward passes route through the rollout's experts (`actor.moe.router_replay`)."""
        return bool(self.engine.chunks[0].config.moe_enable_routing_replay)

    def routing(self, *, replay: bool) -> ExpertRouting:
        """A pass's routing of this actor's routers (`megarl.workers.router_replay`)."""
        return ExpertRouting(
            self.groups, replay=replay, sequence_parallel=self.engine.chunks[0].config.sequence_parallel
        )

    def compute_log_prob(self, batch: PolicyBatch, *, micro_batch_size: int | TokenBudget) -> tuple[Tensor, Tensor]:
        """`log_probs [B, R]` and `entropy [B, R]` of `batch.responses` (fp32, no gradient; padded
        positions hold numbers that mean nothing), on every rank. `micro_batch_size`: samples per
        micro-batch, or a token budget of packed micro-batches.

        With `batch.routed_experts` (a mixture of experts whose engines returned their routing), the pass
        first runs with the routers' own choice and measures it against the rollout's (`routing_metrics`:
        `routing_agreement`, `logprob_gap_no_replay`); with `router_replay` a second pass routes through
        the rollout's experts and gives the result (and `logprob_gap_replay`)."""
        chunks, vocab_size, groups = self.engine.chunks, self.vocab_size, self.groups
        if batch.routed_experts is None:
            return compute_log_probs(chunks, batch, micro_batch_size, vocab_size, groups)
        measured = self.routing(replay=False)
        result = compute_log_probs(chunks, batch, micro_batch_size, vocab_size, groups, routing=measured)
        agreement = measured.agreement()
        self.routing_metrics = {} if agreement is None else {"routing_agreement": agreement}
        self.routing_metrics |= logprob_gap(result[0], batch, groups, "logprob_gap_no_replay")
        if self.router_replay:
            result = compute_log_probs(
                chunks, batch, micro_batch_size, vocab_size, groups, routing=self.routing(replay=True)
            )
            self.routing_metrics |= logprob_gap(result[0], batch, groups, "logprob_gap_replay")
        return result

    def update_policy(
        self,
        batch: PolicyBatch,
        loss_fn: PolicyLossFn,
        *,
        mini_batch_size: int,
        micro_batch_size: int | TokenBudget,
        ppo_epochs: int = 1,
        shuffle_seed: int | None = None,
    ) -> dict[str, float]:
        """`ppo_epochs` passes over `batch` (this DP rank's samples), one optimizer step per
        mini-batch of `mini_batch_size` samples (per DP rank), cut into micro-batches of
        `micro_batch_size` samples or packed under a `TokenBudget` (the step's loss and gradients
        do not depend on the cut: `StepCounts`). With `shuffle_seed`, epoch `e` shuffles rows with seed `shuffle_seed + e`.

        Without `batch.old_log_probs` the update must be exactly on-policy (one mini-batch, one epoch:
        `megarl.config.batch_plan.old_log_prob_pass`): the old log-probs are the detached log-probs of
        its own forward, so the ratio is exactly 1.

        With `batch.loss_mask` the losses, their normalisers and the metrics count its tokens instead of
        `response_mask`'s (DAPO's overlong filtering).

        Returns metrics averaged over the applied optimizer steps (`steps`, `skipped_steps` count
        all): loss, pg_loss, kl_loss, entropy, clip_frac, clip_frac_lower, approx_kl (token means), the
        loss's other `metric_names` (mismatch and correction metrics), grad_norm (before clipping), lr,
        tokens (per step, all DP ranks); a mixture of experts adds its routers' metrics over the whole
        update (`megarl.workers.moe_metrics`), and the routing metrics of the last log-prob pass of a batch
        with routed experts (`compute_log_prob`). With `router_replay` the update's forwards route
        through `batch.routed_experts`.
        """
        batch.require(loss_fn.required_fields, "MegatronActor.update_policy")
        if batch.loss_mask is not None:
            batch = dataclasses.replace(batch, response_mask=batch.loss_mask, loss_mask=None)
        check_divides(len(batch), mini_batch_size, "mini_batch_size", "samples of this DP rank")
        if batch.old_log_probs is None and (mini_batch_size != len(batch) or ppo_epochs != 1):
            raise ValueError(
                f"MegatronActor.update_policy needs PolicyBatch.old_log_probs for {len(batch) // mini_batch_size} "
                f"mini-batch(es) × {ppo_epochs} epoch(s): only one mini-batch in one epoch may take them from its own "
                "forward; compute them first (compute_log_prob)"
            )
        if not isinstance(micro_batch_size, TokenBudget):
            check_divides(mini_batch_size, micro_batch_size, "micro_batch_size", "mini_batch_size")
        keys = ("loss", "entropy", "tokens", *loss_fn.metric_names)
        steps, micro_batch_count = [], 0
        clear_router_losses()  # megatron's tracker is the process's: drop what another model's update left
        for epoch in range(ppo_epochs):
            seed = None if shuffle_seed is None else shuffle_seed + epoch
            for mini_batch in mini_batches(batch, len(batch) // mini_batch_size, shuffle_seed=seed):
                counts = StepCounts.of(mini_batch, loss_fn.loss_agg_mode, self.groups)
                routing = self.routing(replay=self.router_replay)
                forward_step = self._policy_forward_step(loss_fn, counts, routing)
                micro_batches = micro_batches_of(
                    mini_batch, micro_batch_size, self.groups, self.engine.chunks[0].config
                )
                try:
                    sums, result = self.engine.train_step(micro_batches, forward_step, keys)
                finally:
                    routing.close()
                steps.append((sums, result))
                micro_batch_count += len(micro_batches)
        routing_metrics, self.routing_metrics = self.routing_metrics, {}
        return summarize_steps(steps) | self.router_load.take(micro_batch_count) | routing_metrics

    def _policy_forward_step(self, loss_fn: PolicyLossFn, counts: StepCounts, routing: ExpertRouting):
        def forward_step(model, micro_batch: MicroBatch):
            def loss_func(logits):
                log_probs, entropy = response_log_probs(logits, micro_batch, self.vocab_size, self.groups)
                samples = micro_batch.samples
                # Exactly on-policy (checked in update_policy): these weights sampled the batch.
                scored = (
                    samples
                    if samples.old_log_probs is not None
                    else dataclasses.replace(samples, old_log_probs=log_probs.detach())
                )
                loss, metrics = loss_fn(log_probs, entropy, scored, counts)
                mask = samples.response_mask
                reported = dict(
                    loss=loss.detach(),
                    entropy=torch.where(mask, entropy.detach(), 0.0).sum() / counts.tokens,
                    tokens=mask.sum().float(),
                    **metrics,
                )
                return loss, reported

            return routing.forward(model, micro_batch), loss_func

        return forward_step

    def named_parameters_for_sync(self) -> Iterator[tuple[str, Tensor]]:
        """This rank's parameters under megatron names with **global** layer indices
        (`decoder.layers.<local index + this stage's layer offset>.…`), as the live tensors (no
        copies: read them before the next update). TP-sharded tensors are this rank's shard."""
        for chunk in self.engine.chunks:
            yield from global_named_parameters(chunk.module, self.groups)


def global_named_parameters(model: torch.nn.Module, groups: ProcessGroups) -> Iterator[tuple[str, Tensor]]:
    """`model.named_parameters()` (a GPTModel chunk) with `decoder.layers.<i>` renumbered from chunk-local
    to global."""
    offset = chunk_layer_offset(model, model.config.num_layers, groups)
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            _, _, index, rest = name.split(".", 3)
            name = f"decoder.layers.{int(index) + offset}.{rest}"
        yield name, param


def compute_log_probs(
    model: torch.nn.Module,
    batch: PolicyBatch,
    micro_batch_size: int | TokenBudget,
    vocab_size: int,
    groups: ProcessGroups,
    routing: ExpertRouting | None = None,
) -> tuple[Tensor, Tensor]:
    """Forward-only `log_probs [B, R]` and `entropy [B, R]` of `batch.responses`, on every rank; a
    mixture of experts' tokens routed as `routing` says (None: by the routers)."""

    def extract(logits, micro_batch):
        return torch.stack(response_log_probs(logits, micro_batch, vocab_size, groups))

    run = run_model if routing is None else routing.forward
    log_probs, entropy = forward_collect(model, batch, micro_batch_size, groups, extract, num_outputs=2, run=run)
    return log_probs, entropy


def logprob_gap(log_probs: Tensor, batch: PolicyBatch, groups: ProcessGroups, name: str) -> dict[str, float]:
    """`{name: token-mean |log π_rollout - log_probs|}` over the response tokens of every DP rank's batch
    (`log_probs [B, R]`, this rank's); {} without the engines' log-probs."""
    if batch.rollout_log_probs is None:
        return {}
    mask = batch.response_mask
    gap = (log_probs - batch.rollout_log_probs).abs()
    sums = torch.stack([torch.where(mask, gap, 0.0).sum(), mask.sum()]).to(compute_device(), torch.float64)
    all_reduce(sums, groups.dp)
    return {name: (sums[0] / sums[1].clamp(min=1)).item()}


def response_log_probs(
    logits: Tensor, micro_batch: MicroBatch, vocab_size: int, groups: ProcessGroups
) -> tuple[Tensor, Tensor]:
    """`[b, R]` log-probs and entropy of the responses from the model's `[r, T, V_local]` logits (under context
    parallelism this rank's `[1, T / CP, V_local]`: each column's log-prob of the token after it and its entropy,
    then those of the whole row gathered, never the logits: `megarl.workers.context_parallel`)."""
    context = micro_batch.context
    if context is None:
        return vocab_parallel_log_probs(
            micro_batch.response_outputs(logits),
            micro_batch.samples.responses,
            vocab_size=vocab_size,
            tp_group=groups.tp,
            with_entropy=True,
        )
    columns = vocab_parallel_log_probs(
        logits, context.targets, vocab_size=vocab_size, tp_group=groups.tp, with_entropy=True
    )
    both = micro_batch.response_outputs(torch.stack(columns, dim=-1))
    return both[..., 0], both[..., 1]
