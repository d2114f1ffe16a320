"""What the training loop drives: the cluster of a job, behind the calls the loop makes of it.

    cluster = start_cluster(config, plan, total_steps, env, startup, timer=timer, vocab_size=V)
    samples = single_turn(cluster.engines, ...)        # the trainer's rollout phase generates on the engines
    cluster.to_training()                              # engines sleep, the Megatron groups onload
    with cluster.stage(batch, profile, updates) as staged:
        staged.keep("compute_log_prob", ...); staged.update("update_actor", step)
    cluster.save(root, step, extra)                    # on checkpoint steps
    metrics |= cluster.to_rollout(step)                # the training state leaves, the weights sync, engines wake
    metrics |= cluster.pop_memory()
    ...
    cluster.shutdown()

The trainer keeps the loop, the rollout phase, checkpoints (which steps, where, rotation, resume) and metrics;
everything that runs on the worker groups goes through these calls. `megarl.cluster.running.RunningCluster` is
the job's (`start_cluster`); the loop's unit tests run it over in-process fake groups
(`tests/fake_cluster.py`), and `tests/unit/cluster/test_protocol.py` holds both to this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from megarl.cluster.staged_batch import StagedBatch
from megarl.orchestration.worker_group import WorkerGroup
from megarl.workers.batch import PolicyBatch
from megarl.workers.profiling import ProfileRequest


@runtime_checkable
class Cluster(Protocol):
    """The running worker groups of a job as the loop uses them: generate, train, hand over, save, stop."""

    @property
    def engines(self) -> WorkerGroup:
        """The rollout engines' group, which the rollout functions generate with (`megarl.rollout`: single
        turn, the agent loop, partial rollouts take it)."""
        ...

    def to_training(self) -> None:
        """After generating: the engines sleep (colocated) and the Megatron state comes back to the devices
        (`megarl.cluster.handover`)."""
        ...

    def to_rollout(self, step: int) -> dict[str, float]:
        """After step `step`'s updates: the training state leaves, the engines get the step's weights (checked
        on verified steps) and wake; the sync's metrics (`sync/*`)."""
        ...

    def pop_memory(self) -> dict[str, float]:
        """The memory metrics (`memory/<role>/<phase>/<stat>`) the hand-over recorded since the last call."""
        ...

    def stage(
        self, batch: PolicyBatch, profile: ProfileRequest | None = None, updates: Sequence[str] = ()
    ) -> StagedBatch:
        """The step's `batch`, staged once on each group the step calls, with the step's `profile` request;
        `updates`: the update methods the step runs, in order. A context manager (`megarl.cluster.staged_batch`)."""
        ...

    def save(self, root: str, step: int, extra: dict[str, Any]) -> None:
        """Every group with trained state writes step `step`'s checkpoint under `root`, with the driver's
        `extra`; complete once `<root>/step_<step>` exists."""
        ...

    def load(self, path: str) -> dict[str, Any]:
        """Every group restores the checkpoint `path`; its `extra`."""
        ...

    def export_hf(self, root: str) -> None:
        """The actor as an HF checkpoint under `root` (`checkpoint.export_hf`)."""
        ...

    def matmul_peak(self) -> float:
        """The actor group's matmul peak, FLOP/s: the sum of its ranks', benchmarked at once."""
        ...

    def stop_profiles(self) -> list[str]:
        """Every Megatron group's profile recording ends and is written: the trace files."""
        ...

    def shutdown(self) -> None:
        """Stop the engines and the Megatron ranks and release the placement."""
        ...
