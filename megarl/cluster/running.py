"""The job's cluster as the loop drives it (`megarl.cluster.protocol.Cluster`): the worker groups started and
placed on Ray (`roles.start_roles`) with the hand-over between them and the weight sync it runs.

    cluster = start_cluster(config, plan, total_steps, WORKER_ENV, startup, timer=timer, vocab_size=V)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.cluster.handover import HandOver, megatron_groups
from megarl.cluster.roles import Roles, cluster_device, start_roles
from megarl.cluster.staged_batch import StagedBatch
from megarl.cluster.sync_step import WeightSync
from megarl.cluster.timing import PhaseTimer
from megarl.config.batch_plan import BatchPlan
from megarl.config.config import Config
from megarl.orchestration.worker_group import WorkerGroup
from megarl.workers.batch import PolicyBatch
from megarl.workers.profiling import ProfileRequest


class RunningCluster:
    """The running worker groups of a job (`roles`) and the hand-over of the devices between them (`handover`,
    which runs the weight sync)."""

    def __init__(self, roles: Roles, handover: HandOver):
        self.roles = roles
        self.handover = handover

    @classmethod
    def over(
        cls, roles: Roles, config: Config, *, timer: PhaseTimer, vocab_size: int, total_steps: int
    ) -> RunningCluster:
        """The started `roles` with their weight sync and hand-over: the engines sleep when colocated with
        `rollout.free_cache_engine`, and may be generating at `to_training` in `trainer.rollout_mode: async`;
        the hand-over's phases timed by `timer` (the loop's); `vocab_size`: the tokenizer's, for the sync's
        probe batch."""
        sync = WeightSync(roles, config, vocab_size=vocab_size, total_steps=total_steps)
        handover = HandOver(
            roles,
            sync,
            engines_sleep=config.placement.mode == "colocated" and config.rollout.free_cache_engine,
            timer=timer,
            engines_generate_beside=config.trainer.rollout_mode == "async",
        )
        return cls(roles, handover)

    @property
    def sync(self) -> WeightSync:
        """The weight sync the hand-over runs (its resolved dtype and log-prob threshold)."""
        return self.handover.sync

    @property
    def engines(self) -> WorkerGroup:
        return self.roles.rollout

    def to_training(self) -> None:
        self.handover.to_training()

    def to_rollout(self, step: int) -> dict[str, float]:
        return self.handover.to_rollout(step)

    def pop_memory(self) -> dict[str, float]:
        return self.handover.pop_memory()

    def stage(
        self, batch: PolicyBatch, profile: ProfileRequest | None = None, updates: Sequence[str] = ()
    ) -> StagedBatch:
        return self.roles.stage(batch, profile, updates)

    def save(self, root: str, step: int, extra: dict[str, Any]) -> None:
        self.roles.save_checkpoint(root, step, extra)

    def load(self, path: str) -> dict[str, Any]:
        return self.roles.load_checkpoint(path)

    def export_hf(self, root: str) -> None:
        self.roles.policy.call_all("export_hf", root)

    def matmul_peak(self) -> float:
        return float(sum(self.roles.policy.call_all("matmul_peak")))

    def stop_profiles(self) -> list[str]:
        """Each distinct Megatron group's ranks stop recording (`PolicyWorker.stop_profile`): one call per group."""
        return [
            path
            for workers in megatron_groups(self.roles.groups).values()
            for path in workers.call_all("stop_profile")
            if path is not None
        ]

    def shutdown(self) -> None:
        self.roles.shutdown()


def start_cluster(
    config: Config,
    plan: BatchPlan,
    total_steps: int,
    env: dict[str, str],
    startup: PhaseTimer,
    *,
    timer: PhaseTimer,
    vocab_size: int,
) -> RunningCluster:
    """Start the job's groups on the Ray cluster this process is connected to, on the device it resolves
    `trainer.device` to (`cluster_device`), each start-up part timed by `startup`; `timer`, `vocab_size`:
    `RunningCluster.over`'s. What started is stopped again when the rest fails."""
    roles = start_roles(config, plan, total_steps, env, cluster_device(config), startup)
    try:
        return RunningCluster.over(roles, config, timer=timer, vocab_size=vocab_size, total_steps=total_steps)
    except BaseException:
        roles.shutdown()
        raise
