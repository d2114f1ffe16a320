"""What the actor and the critic share: this rank's shard of a model trained by a `TrainEngine`
(Megatron DDP + optimizer), and moving its state off the device while a colocated rollout runs."""

from __future__ import annotations

import torch

from megarl.config.roles import OffloadConfig, OptimizerConfig
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.megatron_train import TrainEngine


class TrainedModel:
    """Base of `MegatronActor` and `MegatronCritic`."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        groups: ProcessGroups,
        optim: OptimizerConfig,
        lr_decay_steps: int | None,
        offload: OffloadConfig,
    ):
        """`chunks`: this rank's megatron `GPTModel` stage, one chunk per virtual stage (weights loaded);
        `optim`, `lr_decay_steps` as `TrainEngine`'s."""
        self.groups = groups
        self.offload_settings = offload
        self.engine = TrainEngine(chunks, optim, lr_decay_steps, groups)

    def offload_training_state(self) -> None:
        """After the update: free what the role's `offload` section names of the gradients and optimizer (no-op on
        CPU); the parameters stay for the weight sync."""
        self.engine.offload_training_state(self.offload_settings)

    def offload_params(self) -> None:
        """After the weight sync: the parameters off the device when `offload.params`. Call
        `onload` before any other method, weight sync included."""
        self.engine.offload_params(self.offload_settings)

    def onload(self) -> None:
        """Undo both offloads."""
        self.engine.onload(self.offload_settings)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient so far."""
        return self.engine.skipped_steps
