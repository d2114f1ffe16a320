"""What the driver's Ray node offers, and the environment its worker processes start with.

Light on imports (no torch, no transformers): `megarl train` reads these to begin starting Ray
(`megarl.orchestration.cluster.start_ray_early`) before it imports the trainer.
"""

from __future__ import annotations

import os

from megarl.config.batch_plan import BatchPlan
from megarl.quiet import python_warnings

WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TOKENIZERS_PARALLELISM": "false",
    # Reaches vLLM's TP worker processes too, which megarl does not start itself (megarl.quiet).
    "PYTHONWARNINGS": python_warnings(),
}
"""The environment of every worker process: vLLM's settings must be in place before vLLM is imported there."""


def device_bundles(plan: BatchPlan) -> tuple[int, float]:
    """How many device bundles the job reserves, and the CPU cores of one: one for every process that
    shares a training bundle (`plan.processes_per_train_gpu`; a split rollout's bundles, one process
    each, have the same shape)."""
    bundles = plan.train_gpus + (0 if plan.colocated else plan.rollout_gpus)
    return bundles, float(plan.processes_per_train_gpu)


def ray_cpus(plan: BatchPlan) -> int:
    """The CPUs a local Ray instance offers: this machine's, or more where the job's bundles reserve
    more (a colocated run of several processes per device on a small machine)."""
    bundles, cpus = device_bundles(plan)
    return max(os.cpu_count() or 1, int(bundles * cpus))
