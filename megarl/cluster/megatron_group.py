"""A worker group of Megatron ranks and each rank's place in its grid: what `Roles` (`megarl.cluster.roles`)
holds per role, what a staged batch is cut for (`megarl.cluster.staged_batch`) and what `megarl sft` trains
with; and which rank's result stands for its DP replica (`is_dp_leader`, `gather_by_dp`). Apart from `roles`
so that the modules `roles` imports can name it without importing `roles` back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.orchestration.placement import BundleSpec
from megarl.orchestration.worker_group import DEFAULT_HANG_TIMEOUT_S, Call, WorkerGroup

POLICY_TARGET = "megarl.workers.policy_worker:PolicyWorker"


@dataclass
class MegatronGroup:
    """A worker group of Megatron ranks (`PolicyWorker`s) and each rank's place in its grid."""

    workers: WorkerGroup
    grids: list[dict[str, int]]
    """Per rank: rank, tp_rank, pp_rank, dp_rank, dp_size."""

    @classmethod
    def start(
        cls,
        name: str,
        spec,
        world_size: int,
        placement,
        bundle: BundleSpec,
        env: dict[str, str],
        target: str = POLICY_TARGET,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        bundles: list[int] | None = None,
    ) -> MegatronGroup:
        """`world_size` ranks of `target` (a worker class taking `spec`, with a `grid()` method: a
        `PolicyWorker`, or `megarl sft`'s `SftWorker`), rank r on bundle `bundles[r]` (default r)."""
        workers = WorkerGroup(
            name,
            target,
            world_size,
            placement,
            bundle,
            init_kwargs={"spec": spec},
            env=env,
            hang_timeout_s=hang_timeout_s,
            bundles=bundles,
        )
        return cls(workers, workers.call_all("grid"))

    @property
    def dp_size(self) -> int:
        return self.grids[0]["dp_size"]

    def call_by_dp(
        self, method: str, per_dp: list[tuple], replies: Callable[[dict[str, int]], bool] | None = None
    ) -> list:
        """Each rank runs `method` with its DP replica's arguments (stored once per replica, read by its
        TP × PP ranks); results in rank order. `replies(grid)` False: that rank's result stays there (None)."""
        replying = None if replies is None else [replies(g) for g in self.grids]
        return self.workers.call_each(method, [per_dp[g["dp_rank"]] for g in self.grids], replying=replying)

    def chain_by_dp(self, per_dp: list[list[Call]], replies: Callable[[dict[str, int]], bool]) -> list:
        """`call_by_dp` for chains: each rank runs its DP replica's calls in order, in one round trip; per
        rank the calls' results (None where `replies(grid)` is False)."""
        replying = [replies(g) for g in self.grids]
        return self.workers.submit([per_dp[g["dp_rank"]] for g in self.grids], replying=replying).wait()


def is_dp_leader(grid: dict[str, int]) -> bool:
    """The rank whose copy of its DP replica's result is taken: TP rank 0 of the first stage."""
    return grid["tp_rank"] == 0 and grid["pp_rank"] == 0


def gather_by_dp(per_rank: Sequence[Tensor | None], grids: Sequence[dict[str, int]]) -> Tensor:
    """Concatenate one result per DP replica (taken from its leader, `is_dp_leader`), in DP order."""
    leaders = {g["dp_rank"]: result for g, result in zip(grids, per_rank) if is_dp_leader(g)}
    return torch.cat([leaders[d] for d in range(len(leaders))], dim=0)
