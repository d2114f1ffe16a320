"""What a context-parallel micro-batch carries about its rank's share of the row (`MicroBatch.context`), and
the gather of the ranks' per-token outputs; the split itself is `megarl.workers.context_parallel`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch import Tensor


@dataclass
class ContextShard:
    """Which of a THD row's `t` columns this CP rank holds, and how to put every rank's back together."""

    group: dist.ProcessGroup
    """The context-parallel group."""
    columns: Tensor
    """`[t / CP]` int64: the row column of each of this rank's tokens, in their local order."""
    targets: Tensor
    """`[1, t / CP]` int64: the token after each of this rank's columns in the row (what the column
    predicts; 0 after the row's last token, which nothing reads)."""
    order: Tensor
    """`[t]` int64: where column `c` of the row lies in the ranks' columns concatenated in rank order."""

    def gather(self, local: Tensor) -> Tensor:
        """`[1, t, ...]` the whole row's outputs from every rank's `local` `[1, t / CP, ...]`; differentiable,
        each rank's gradient flowing back to its own columns only (every rank computes the same loss)."""
        parts = gather_from_sequence_parallel_region(local[0], tensor_parallel_output_grad=False, group=self.group)
        return parts[self.order][None]

    def to(self, device: torch.device) -> ContextShard:
        return dataclasses.replace(
            self, columns=self.columns.to(device), targets=self.targets.to(device), order=self.order.to(device)
        )
