"""The reference policy: a frozen copy of the initial actor, for KL terms.

No DDP, no optimizer, no gradients. In the actor's processes and process groups (the same
`ProcessGroups`, a separate model instance) when it has the actor's layout; else in processes of
its own (`megarl.cluster.roles`).

    reference = MegatronReference.from_hf("/ckpt/tiny", groups, model=config.model)
    ref_log_probs = reference.compute_ref_log_prob(batch, micro_batch_size=8)   # [B, R]
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from megarl.config.roles import MoeConfig, RecomputeConfig
from megarl.config.sections import ModelConfig
from megarl.parallel.device import uses_cuda
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.actor import compute_log_probs
from megarl.workers.batch import PolicyBatch
from megarl.workers.megatron_train import load_model
from megarl.workers.packing import TokenBudget
from megarl.workers.router_replay import ExpertRouting


class MegatronReference:
    """This rank's shard of the reference model, frozen at construction."""

    def __init__(self, chunks: list[torch.nn.Module], groups: ProcessGroups, *, vocab_size: int):
        """`chunks`: this rank's GPTModel stage, one chunk per virtual stage (weights loaded); `vocab_size`:
        the real (HF) vocabulary size."""
        self.chunks = [chunk.eval().requires_grad_(False) for chunk in chunks]
        self.groups = groups
        self.vocab_size = vocab_size

    @classmethod
    def from_hf(
        cls,
        model_dir: str | Path,
        groups: ProcessGroups,
        *,
        model: ModelConfig,
        sequence_parallel: bool = False,
        router_replay: bool = False,
    ) -> MegatronReference:
        """Build this rank's shard from an HF checkpoint dir (the actor's initial weights); `sequence_parallel`
        as `ref.parallel.sequence_parallel`; `router_replay`: a mixture of experts routes the tokens of a
        batch with routed experts through them, as the actor does (`actor.moe.router_replay`)."""
        chunks, vocab_size = load_model(
            model_dir,
            groups,
            model=model,
            recompute=RecomputeConfig(),
            value_head=False,
            sequence_parallel=sequence_parallel,
            moe=MoeConfig(router_replay=router_replay),
        )
        return cls(chunks, groups, vocab_size=vocab_size)

    def offload(self) -> None:
        """Move the weights to host memory between log-prob passes (no-op on CPU)."""
        if uses_cuda():
            for chunk in self.chunks:
                chunk.cpu()
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Undo `offload`."""
        if uses_cuda():
            for chunk in self.chunks:
                chunk.cuda()

    def compute_ref_log_prob(self, batch: PolicyBatch, *, micro_batch_size: int | TokenBudget) -> Tensor:
        """`[B, R]` log-probs of `batch.responses` under the reference model, on every rank
        (`micro_batch_size`: samples per micro-batch, or a token budget of packed micro-batches)."""
        config = self.chunks[0].config
        replay = config.moe_enable_routing_replay
        routing = (
            ExpertRouting(self.groups, replay=True, sequence_parallel=config.sequence_parallel) if replay else None
        )
        log_probs, _ = compute_log_probs(self.chunks, batch, micro_batch_size, self.vocab_size, self.groups, routing)
        return log_probs
