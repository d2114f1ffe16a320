"""One Megatron rank of `megarl sft`: the actor trained on demonstrations with the negative
log-likelihood loss (the RL actor's own update path: same model code, schedule, DDP and optimizer),
and its HF export. A plain class; `megarl.trainer.sft` hosts one per rank process.

    worker = SftWorker(SftWorkerSpec(...))          # builds the grid, loads the HF weights
    metrics = worker.train_step(batch)              # one optimizer step over this DP rank's conversations
    worker.export_hf("/out/model")                  # collective; the directory appears complete or not at all
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.models.checkpoint import export_hf_weights
from megarl.parallel.distributed import initialize_model_parallel
from megarl.workers.actor import MegatronActor
from megarl.workers.batch import PolicyBatch
from megarl.workers.megatron_train import StepCounts
from megarl.workers.settings import SftWorkerSpec


class NllLoss:
    """`PolicyLossFn` of supervised fine-tuning: the mean negative log-likelihood of the loss-masked
    tokens (`response_mask`) of the whole optimizer step. Each micro-batch adds its masked sum divided by
    the step's token count (`counts.normalizer`, summed over micro-batches and DP ranks), so the step
    loss and its gradient do not depend on how the step is cut into micro-batches."""

    loss_agg_mode = "token-mean"
    metric_names: tuple[str, ...] = ()
    required_fields: tuple[str, ...] = ()

    def __call__(
        self, log_probs: Tensor, entropy: Tensor, batch: PolicyBatch, counts: StepCounts
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`log_probs [b, R]` of the micro-batch's tokens; its share of the step's mean NLL."""
        return -torch.where(batch.response_mask, log_probs, 0.0).sum() / counts.normalizer, {}


class SftWorker:
    """The trained model of one rank."""

    def __init__(self, spec: SftWorkerSpec):
        self.spec = spec
        self.groups = initialize_model_parallel(
            spec.tp, spec.pp, spec.seed, vpp=spec.vpp, ep=spec.ep, etp=spec.etp, cp=spec.cp
        )
        self.actor = MegatronActor.from_hf(
            spec.model_path,
            self.groups,
            optim=spec.optim,
            lr_decay_steps=spec.lr_decay_steps,
            model=spec.model,
            sequence_parallel=spec.sequence_parallel,
        )
        self.loss = NllLoss()

    def grid(self) -> dict[str, int]:
        """This rank's place in the (TP, PP, DP) grid."""
        g = self.groups
        return dict(rank=dist.get_rank(), tp_rank=g.tp_rank, pp_rank=g.pp_rank, dp_rank=g.dp_rank, dp_size=g.dp_size)

    def train_step(self, batch: PolicyBatch) -> dict[str, float]:
        """One optimizer step over this DP rank's conversations (`sft_policy_batch`), in micro-batches.
        Metrics of the whole step (reduced over DP): loss (mean NLL per trained token), entropy, tokens
        (trained tokens), grad_norm, lr, skipped_steps."""
        return self.actor.update_policy(
            batch, self.loss, mini_batch_size=len(batch), micro_batch_size=self.spec.micro_batch_size
        )

    def export_hf(self, out_dir: str) -> str | None:
        """Collective: the model as an HF checkpoint dir `out_dir` (replaced atomically; written by one rank),
        with config.json and the tokenizer of `model_path`. The dir on the ranks that wrote, else None."""
        path = export_hf_weights(
            [chunk.module for chunk in self.actor.engine.chunks],
            out_dir,
            self.groups,
            hf_assets_dir=self.spec.model_path,
        )
        return None if path is None else str(path)
