"""The optional reward model (`reward.reward_model`): an HF `*ForSequenceClassification` checkpoint
(one label) run as a frozen Megatron GPT with a scalar head, one score per sample.

    rm = MegatronRewardModel.from_hf("/ckpt/rm", groups, model=config.model)          # any (TP, PP), like the actor
    scores = rm.compute_scores(batch, micro_batch_size=8)           # [B], fp32, on every rank

The backbone loads like a policy's; the head is the checkpoint's `score.weight` in a `ValueHead`.
As in HF, the score of a sample is the head's output at its last real token: the last response
token that `response_mask` keeps, or the last prompt token when it keeps none.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from megarl.config.roles import RecomputeConfig
from megarl.config.sections import ModelConfig
from megarl.models.reward_head import read_score_weight
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.batch import PolicyBatch
from megarl.workers.megatron_train import (
    broadcast_from_last_stage,
    compute_device,
    load_model,
    micro_batches_of,
    run_model,
    run_schedule,
)
from megarl.workers.micro_batches import MicroBatch


class MegatronRewardModel:
    """This rank's shard of the reward model: no DDP, no optimizer, no gradients."""

    def __init__(self, model: list[torch.nn.Module], groups: ProcessGroups):
        """`model`: this rank's GPTModel built with `value_head=True`, reward-model weights loaded; one
        chunk per virtual stage."""
        self.chunks = [chunk.eval().requires_grad_(False) for chunk in model]
        self.groups = groups

    @classmethod
    def from_hf(cls, model_dir: str | Path, groups: ProcessGroups, *, model: ModelConfig) -> MegatronRewardModel:
        """Build this rank's shard from an HF reward-model checkpoint dir (see the module docstring)."""
        # Read (and check) the head before building: construction runs collectives, a bad checkpoint must not hang.
        score_weight = read_score_weight(model_dir)
        model, _ = load_model(
            model_dir,
            groups,
            model=model,
            recompute=RecomputeConfig(),
            value_head=True,
            sequence_parallel=False,
        )
        if groups.is_last_stage:
            with torch.no_grad():
                model[-1].output_layer.weight.copy_(score_weight)
        return cls(model, groups)

    def compute_scores(self, batch: PolicyBatch, *, micro_batch_size: int) -> Tensor:
        """`[B]` scores of `batch` (fp32, no gradient), on every rank."""

        def forward_step(model, micro_batch):
            def collect(output):
                return output.new_zeros(()), dict(scores=last_token_scores(output, micro_batch))

            return run_model(model, micro_batch), collect

        device = compute_device()
        micro_batches = micro_batches_of(batch, micro_batch_size, self.groups, self.chunks[0].config)
        with torch.no_grad():
            reports = run_schedule(self.chunks, micro_batches, forward_step, forward_only=True)
        scores = torch.zeros(len(batch), device=device)
        if self.groups.is_last_stage:
            scores.copy_(torch.cat([report["scores"] for report in reports]))
        return broadcast_from_last_stage(scores, self.groups).cpu()


def last_token_scores(output: Tensor, micro_batch: MicroBatch) -> Tensor:
    """`[b]` fp32 head outputs at each sample's last real token, from the head's `[r, T, 1]` output in
    any layout of `micro_batch`: with `k` response tokens up to the last kept one, that token sits
    in the column that predicts response token `k` (`response_index`), or, when `k` is the response
    width, in the column after the one predicting the last."""
    samples = micro_batch.samples
    width = samples.response_length
    kept = (samples.response_mask * torch.arange(1, width + 1, device=output.device)).amax(dim=1)
    index = micro_batch.response_index
    columns = torch.where(kept < width, index.gather(1, kept.clamp(max=width - 1)[:, None])[:, 0], index[:, -1] + 1)
    return micro_batch.whole_row(output).flatten(0, 1)[columns, 0].float()
