"""Which training steps the Megatron ranks profile (`trainer.profile`), and the driver's two touches of it.

    request = profile_request(config.trainer.profile, run_dir, step)   # None on steps not profiled
    with cluster.stage(batch, request) as staged: ...                  # the chosen ranks start recording
    ... the updates, the hand-over and the weight sync ...
    cluster.stop_profiles()                                            # profiled steps: each group writes

Starting rides on the step's first call to each group (`PolicyWorker.stage_batch`); stopping is one
extra call per group, on profiled steps only. Which ranks record is each worker's decision
(`ProfileRequest.chosen`), so the driver sends every rank the same request.
"""

from __future__ import annotations

from pathlib import Path

from megarl.config.sections import ProfileConfig
from megarl.workers.profiling import ProfileRequest

PROFILE_DIR = "profile"
"""In the run directory: the traces' root unless `trainer.profile.dir` names another."""


def profile_request(profile: ProfileConfig, run_dir: Path, step: int) -> ProfileRequest | None:
    """Step `step`'s profile for the workers, or None when `profile.steps` does not list it."""
    if step not in profile.steps:
        return None
    ranks = None if profile.ranks == "all" else tuple(profile.ranks)
    directory = Path(profile.dir) if profile.dir else run_dir / PROFILE_DIR
    return ProfileRequest(step, str(directory.absolute()), ranks)  # the workers' working directory may differ
