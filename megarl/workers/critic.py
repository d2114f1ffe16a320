"""The critic: the policy's backbone with a scalar value head, trained with the clipped value loss.

    critic = MegatronCritic.from_hf("/ckpt/tiny", groups, optim=OptimizerConfig(lr=1e-5),
                                    loss=config.critic, model=config.model)
    values = critic.compute_values(batch, micro_batch_size=8)            # [B, R]
    metrics = critic.update_critic(batch, mini_batch_size=16, micro_batch_size=4)

The backbone loads the HF checkpoint; the value head (`output_layer.weight`, `[1, H]`) starts from a
small normal init (std = the config's `initializer_range`). Each value is read at the position
that predicts its response token (the state before the token), like the actor's log-probs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from megarl.algorithms.losses import LOSS_AGG_MODES
from megarl.algorithms.value_loss import compute_value_loss
from megarl.config.roles import CriticConfig, OffloadConfig, OptimizerConfig, RecomputeConfig
from megarl.config.sections import ModelConfig
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.batch import PolicyBatch, mini_batches
from megarl.workers.megatron_train import (
    StepCounts,
    check_divides,
    forward_collect,
    load_model,
    micro_batches_of,
    run_model,
    summarize_steps,
)
from megarl.workers.micro_batches import MicroBatch
from megarl.workers.packing import TokenBudget
from megarl.workers.trained_model import TrainedModel


class MegatronCritic(TrainedModel):
    """The value model of this rank (its TP × PP shard), trained with Megatron DDP and optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        groups: ProcessGroups,
        *,
        optim: OptimizerConfig,
        lr_decay_steps: int | None = None,
        loss: CriticConfig,
        offload: OffloadConfig = OffloadConfig(),
    ):
        """`model`: this rank's GPTModel built with `value_head=True` (last stage outputs `[b, S, 1]`); `loss`:
        the `critic` section, whose `cliprange_value` and `loss_agg_mode` make the value loss."""
        if loss.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode={loss.loss_agg_mode!r} is not one of {LOSS_AGG_MODES}; pick one of them")
        self.loss = loss
        super().__init__(model, groups, optim, lr_decay_steps, offload)

    @classmethod
    def from_hf(
        cls,
        model_dir: str | Path,
        groups: ProcessGroups,
        *,
        optim: OptimizerConfig,
        lr_decay_steps: int | None = None,
        loss: CriticConfig,
        model: ModelConfig,
        recompute: RecomputeConfig = RecomputeConfig(),
        offload: OffloadConfig = OffloadConfig(),
        sequence_parallel: bool = False,
    ) -> MegatronCritic:
        """Build this rank's shard from an HF (policy) checkpoint dir: backbone weights loaded,
        value head freshly initialised; `sequence_parallel` as `critic.parallel.sequence_parallel`; `optim`,
        `lr_decay_steps` as `megarl.workers.megatron_train.TrainEngine`'s."""
        model, _ = load_model(
            model_dir,
            groups,
            model=model,
            recompute=recompute,
            value_head=True,
            sequence_parallel=sequence_parallel,
        )
        return cls(model, groups, optim=optim, lr_decay_steps=lr_decay_steps, loss=loss, offload=offload)

    def compute_values(self, batch: PolicyBatch, *, micro_batch_size: int | TokenBudget) -> Tensor:
        """`[B, R]` values of the states before each response token (fp32, no gradient), on every rank."""
        (values,) = forward_collect(
            self.engine.chunks,
            batch,
            micro_batch_size,
            self.groups,
            lambda output, micro_batch: response_values(output, micro_batch)[None],
            num_outputs=1,
        )
        return values

    def update_critic(
        self,
        batch: PolicyBatch,
        *,
        mini_batch_size: int,
        micro_batch_size: int | TokenBudget,
        ppo_epochs: int = 1,
        shuffle_seed: int | None = None,
    ) -> dict[str, float]:
        """Clipped value regression of `batch.returns` (needs `batch.values`, the rollout-time values);
        batching as `MegatronActor.update_policy`.

        Returns metrics averaged over the applied optimizer steps: loss (the value loss), clip_frac
        (fraction of tokens where the clipped term was taken), vpred_mean (token mean of the
        predictions), grad_norm, lr, tokens, plus `steps` and `skipped_steps`.
        """
        batch.require(("values", "returns"), "MegatronCritic.update_critic")
        check_divides(len(batch), mini_batch_size, "mini_batch_size", "samples of this DP rank")
        if not isinstance(micro_batch_size, TokenBudget):
            check_divides(mini_batch_size, micro_batch_size, "micro_batch_size", "mini_batch_size")
        steps = []
        for epoch in range(ppo_epochs):
            seed = None if shuffle_seed is None else shuffle_seed + epoch
            for mini_batch in mini_batches(batch, len(batch) // mini_batch_size, shuffle_seed=seed):
                counts = StepCounts.of(mini_batch, self.loss.loss_agg_mode, self.groups)
                steps.append(
                    self.engine.train_step(
                        micro_batches_of(mini_batch, micro_batch_size, self.groups, self.engine.chunks[0].config),
                        self._value_forward_step(counts),
                        ("loss", "clip_frac", "vpred_mean", "tokens"),
                    )
                )
        return summarize_steps(steps)

    def _value_forward_step(self, counts: StepCounts):
        def forward_step(model, micro_batch: MicroBatch):
            def loss_func(output):
                vpreds = response_values(output, micro_batch)
                samples = micro_batch.samples
                mask = samples.response_mask
                loss, clip_frac = compute_value_loss(
                    vpreds,
                    samples.values,
                    samples.returns,
                    mask,
                    cliprange_value=self.loss.cliprange_value,
                    loss_agg_mode=self.loss.loss_agg_mode,
                    global_normalizer=counts.normalizer,
                )
                tokens = mask.sum()
                # compute_value_loss reports a micro-batch token mean; weight it into the step's.
                reported = dict(
                    loss=loss.detach(),
                    clip_frac=clip_frac * tokens / counts.tokens,
                    vpred_mean=torch.where(mask, vpreds.detach(), 0.0).sum() / counts.tokens,
                    tokens=tokens.float(),
                )
                return loss, reported

            return run_model(model, micro_batch), loss_func

        return forward_step


def response_values(output: Tensor, micro_batch: MicroBatch) -> Tensor:
    """`[b, R]` values of the response tokens from the value head's `[r, T, 1]` output."""
    return micro_batch.response_outputs(output)[..., 0].float()
