"""The checks of the run itself (`megarl.config.validate` runs them): `trainer` (rollout mode, timeouts, names,
loggers), `checkpoint` (directories, the resume path), `trainer.profile` and the seeds."""

import os
from pathlib import Path

from megarl.config.batch_plan import plan_batches
from megarl.config.config import Config
from megarl.config.problems import ConfigError, Problem
from megarl.config.resources import local_path, unusable_path, writable_dir_problem
from megarl.config.role_checks import need
from megarl.workers.checkpoint_files import STEP_DIR, CheckpointError, read_manifest

MIN_HANG_TIMEOUT_S = 10.0
"""The shortest trainer.hang_timeout_s: ten missed heartbeats."""


def check_trainer(config: Config, check_files: bool, problems: list[Problem]) -> None:
    trainer, checkpoint = config.trainer, config.checkpoint
    need(problems, trainer.total_epochs >= 1, "trainer.total_epochs", trainer.total_epochs, "must be >= 1", "e.g. 1")
    need(
        problems,
        trainer.total_steps is None or trainer.total_steps >= 1,
        "trainer.total_steps",
        trainer.total_steps,
        "must be >= 1",
        "e.g. 100, or null to run all epochs",
    )
    need(
        problems, trainer.test_freq >= 0, "trainer.test_freq", trainer.test_freq, "must be >= 0 (0 disables)", "e.g. 10"
    )
    need(
        problems,
        trainer.test_freq == 0 or len(config.data.val_files) > 0,
        "trainer.test_freq",
        trainer.test_freq,
        "validation is requested but data.val_files is empty",
        "list data.val_files, or set trainer.test_freq=0",
    )
    need(problems, trainer.max_bad_steps >= 1, "trainer.max_bad_steps", trainer.max_bad_steps, "must be >= 1", "e.g. 3")
    need(
        problems,
        trainer.hang_timeout_s >= MIN_HANG_TIMEOUT_S,
        "trainer.hang_timeout_s",
        trainer.hang_timeout_s,
        f"must be >= {MIN_HANG_TIMEOUT_S:g} seconds (a worker beats once a second; a shorter limit takes a busy "
        "machine's delay for a stopped process)",
        "e.g. 600",
    )
    need(
        problems,
        trainer.rollout_mode == "sync" or config.placement.mode == "split",
        "trainer.rollout_mode",
        trainer.rollout_mode,
        "generating batches while the actor trains needs the rollout engines on "
        "devices of their own, but placement.mode is colocated (the engines and the actor take turns on the same "
        "devices)",
        "set placement.mode: split with placement.rollout_gpus for the engines, or trainer.rollout_mode: sync",
    )
    need(
        problems,
        trainer.max_staleness >= 0,
        "trainer.max_staleness",
        trainer.max_staleness,
        "must be >= 0 (the weight versions a batch may lag the actor in trainer.rollout_mode: async)",
        "e.g. 1",
    )
    need(
        problems,
        trainer.peak_flops is None or trainer.peak_flops > 0,
        "trainer.peak_flops",
        trainer.peak_flops,
        "must be > 0",
        "e.g. 989e12 per H100 in bf16 times the actor's GPUs, or null to measure it",
    )
    need(
        problems,
        _is_plain_name(trainer.experiment_name),
        "trainer.experiment_name",
        trainer.experiment_name,
        "names the run's directory inside trainer.output_dir, so it must not be empty, '.', '..', or hold a path "
        "separator (the run directory would land outside trainer.output_dir)",
        "use a plain name such as gsm8k-grpo-run1; choose the parent with trainer.output_dir",
    )
    need(
        problems,
        len(set(trainer.loggers)) == len(trainer.loggers),
        "trainer.loggers",
        list(trainer.loggers),
        "a logger is listed twice",
        "list each logger once",
    )
    need(
        problems,
        checkpoint.save_freq >= 0,
        "checkpoint.save_freq",
        checkpoint.save_freq,
        "must be >= 0 (0 saves only at the end)",
        "e.g. 50",
    )
    need(
        problems,
        checkpoint.max_keep is None or checkpoint.max_keep >= 1,
        "checkpoint.max_keep",
        checkpoint.max_keep,
        "must be >= 1",
        "e.g. 3, or null to keep all",
    )
    if not check_files:
        return
    for key, directory in (("checkpoint.dir", checkpoint.dir), ("trainer.output_dir", trainer.output_dir)):
        problem = writable_dir_problem(key, directory)
        if problem is not None:
            problems.append(problem)
    if checkpoint.resume not in ("auto", "disable"):
        problem = _resume_problem(checkpoint.resume)
        if problem is not None:
            problems.append(problem)


def check_profile(config: Config, check_files: bool, problems: list[Problem]) -> None:
    profile = config.trainer.profile
    steps, ranks = list(profile.steps), profile.ranks
    need(
        problems,
        all(step >= 1 for step in steps) and len(set(steps)) == len(steps),
        "trainer.profile.steps",
        steps,
        "steps count from 1 and are listed once each",
        "e.g. [3, 4]: a few steps after the first (warm-up)",
    )
    if ranks != "all":
        need(
            problems,
            len(ranks) > 0,
            "trainer.profile.ranks",
            [],
            "no rank would record the profiled steps",
            "e.g. [0], or all",
        )
        need(
            problems,
            all(rank >= 0 for rank in ranks) and len(set(ranks)) == len(ranks),
            "trainer.profile.ranks",
            list(ranks),
            "ranks count from 0 and are listed once each",
            "e.g. [0], or all",
        )
        try:
            train_gpus = plan_batches(config).train_gpus  # each Megatron group spans the training devices
        except ConfigError:  # batch_problems reports why
            train_gpus = None
        need(
            problems,
            train_gpus is None or all(rank < train_gpus for rank in ranks),
            "trainer.profile.ranks",
            list(ranks),
            f"the Megatron groups have ranks 0 .. {(train_gpus or 1) - 1} ({train_gpus} training devices)",
            f"list ranks below {train_gpus}, or all",
        )
    if check_files and profile.dir:
        problem = writable_dir_problem("trainer.profile.dir", profile.dir)
        if problem is not None:
            problems.append(problem)


def _is_plain_name(name: str) -> bool:
    """A single directory name: `output_dir / name` stays inside output_dir."""
    return name not in ("", ".", "..") and not any(sep in name for sep in ("/", "\\", "\0"))


def _resume_problem(resume: str) -> Problem | None:
    """A `checkpoint.resume` path that is not a complete checkpoint, found now rather than after Ray and
    the engines started (the manifest check is the one `megarl train` runs on resume)."""
    path = local_path(resume)
    if not os.path.isdir(path):
        why = unusable_path(resume) or "neither auto, disable nor an existing checkpoint directory"
        return Problem(
            "checkpoint.resume",
            resume,
            why,
            "use auto (newest in checkpoint.dir), disable, or the path of a saved checkpoint",
        )
    try:
        read_manifest(path)
    except CheckpointError as error:
        if any(_is_checkpoint(child) for child in path.iterdir() if STEP_DIR.match(child.name)):
            fix = f"point it at one of its step_<N> directories, or set checkpoint.dir={resume} and checkpoint.resume=auto"
            return Problem("checkpoint.resume", resume, "a directory of checkpoints, not a checkpoint", fix)
        return Problem(
            "checkpoint.resume",
            resume,
            f"not a checkpoint: {error}",
            "use auto, disable, or a step_<N> directory that megarl saved",
        )
    return None


def _is_checkpoint(path: Path) -> bool:
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


# Offsets are added to a seed per pipeline stage, TP rank and step (megarl.parallel.seed,
# megarl.trainer.settings.step_seed); torch takes seeds below 2**64, so half that range is left for them.
MAX_SEED = 2**63 - 1


def check_seeds(config: Config, problems: list[Problem]) -> None:
    for key, seed in (
        ("trainer.seed", config.trainer.seed),
        ("data.seed", config.data.seed),
        ("rollout.seed", config.rollout.seed),
    ):
        need(
            problems,
            0 <= seed <= MAX_SEED,
            key,
            seed,
            f"a seed must lie in [0, 2**63 - 1 = {MAX_SEED}]",
            "e.g. 0 or 1234",
        )
