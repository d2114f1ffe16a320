"""`megarl train CONFIG [key=value ...]`: validate, then run the RL loop."""

import argparse
import shlex
import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model with GRPO / PPO / DAPO from a recipe",
        description="Validate CONFIG (with key.sub=value overrides), then run the RL loop on Ray.",
    )
    parser.add_argument("config", help="recipe YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. trainer.total_steps=20")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megarl import credentials
    from megarl.cluster.ray_node import WORKER_ENV, ray_cpus
    from megarl.config.batch_plan import plan_batches
    from megarl.config.problems import ConfigError
    from megarl.config.validate import checked_config
    from megarl.orchestration.cluster import RayStartError, check_ray_can_start, shutdown_ray, start_ray_early
    from megarl.run_lock import DirectoryBusy, DirectoryLocks

    try:
        config = checked_config(args.config, args.overrides)
    except ConfigError as error:
        return _config_problems(error)
    try:
        check_ray_can_start()
        locks = DirectoryLocks.acquire(
            run_locks(config), shlex.join(["megarl", "train", args.config, *args.overrides]), "megarl train"
        )
    except (RayStartError, DirectoryBusy) as error:
        print(f"megarl train: {error}", file=sys.stderr)
        return 1
    with locks:
        # Before Ray and user code start: no process of the run holds a credential (megarl.credentials).
        credentials.withhold()
        # The Ray node comes up on the other cores while the trainer's imports and the data load run here.
        start_ray_early(ray_cpus(plan_batches(config)), WORKER_ENV)
        try:
            return _train(config)
        finally:
            shutdown_ray()  # after a run, a no-op: the trainer stopped Ray; before one, the early start's node


def run_locks(config) -> list[tuple[str, Path, Path]]:
    """The lock files of the directories a run writes: its run directory (`Trainer.run_dir`: metrics,
    rollouts, run_config.json) and its checkpoint root (saves, `resume: auto`, `max_keep` rotation)."""
    from megarl.run_lock import LOCK_NAME

    run_dir = Path(config.trainer.output_dir) / config.trainer.experiment_name
    checkpoints = Path(config.checkpoint.dir).expanduser()
    return [
        ("trainer.output_dir", run_dir, run_dir / LOCK_NAME),
        ("checkpoint.dir", checkpoints, checkpoints / LOCK_NAME),
    ]


def _config_problems(error) -> int:
    for problem in error.problems:
        print(f"megarl train: {problem}", file=sys.stderr)
    return 2


def _train(config) -> int:
    from megarl import interrupt
    from megarl.bridge.verify import SyncVerificationError
    from megarl.cli.stop_signals import StopOnSignal, doing, resume_hint, stopped_line
    from megarl.config.problems import ConfigError
    from megarl.data import DataError
    from megarl.orchestration.cluster import RayStartError
    from megarl.orchestration.worker_group import WorkerFailure
    from megarl.rewards.functions import RewardFunctionError
    from megarl.tools import ToolError
    from megarl.trainer.checkpoint_manager import CheckpointError
    from megarl.trainer.metrics import reward_trend
    from megarl.trainer.sinks import METRICS_FILE, LoggerSetupError, read_metrics_file
    from megarl.trainer.trainer import BadStepsError, Trainer

    try:
        trainer = Trainer(config)
    except ConfigError as error:
        return _config_problems(error)
    except (DataError, ToolError) as error:
        print(f"megarl train: {error}", file=sys.stderr)
        return 2
    except CheckpointError as error:  # the checkpoint to resume is damaged (`checkpoint.resume` names it)
        print(f"megarl train: failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    try:
        try:
            with StopOnSignal(lambda: (trainer.step_in_progress, list(trainer.timer.active))):
                metrics = trainer.fit()
        except Exception:
            stopped = interrupt.requested()
            if stopped is None:
                raise
            # A stop signal ended the run (a failure it caused while stopping counts as the stop); fit's
            # clean-up has run.
            print(stopped_line("train", stopped, trainer.checkpoints.latest()), file=sys.stderr)
            return stopped.exit_code
    except (RewardFunctionError, ToolError, LoggerSetupError) as error:
        print(f"megarl train: {error}", file=sys.stderr)
        return 2
    except WorkerFailure as error:
        # A process or machine failed, not the recipe: the run can continue from its last checkpoint.
        print(
            f"megarl train: failed during {doing(trainer.step_in_progress, trainer.timer.failed_in)}: "
            f"{type(error).__name__}: {error}\n{resume_hint(trainer.checkpoints.latest())}",
            file=sys.stderr,
        )
        return 1
    except RayStartError as error:
        print(f"megarl train: {error}", file=sys.stderr)
        return 1
    except (BadStepsError, SyncVerificationError, CheckpointError) as error:
        # Failures megarl diagnosed itself: the message names the cause; a traceback adds nothing.
        print(f"megarl train: failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if not metrics:
        print(
            f"megarl train: the run in {trainer.run_dir} was already complete at step {trainer.total_steps} "
            "(checkpoint.resume=auto continued from its last checkpoint); nothing to train. To train again: "
            "checkpoint.resume=disable, or another trainer.output_dir"
        )
        return 0
    trend = reward_trend(read_metrics_file(trainer.run_dir / METRICS_FILE))
    print(
        f"megarl train: done after step {trainer.total_steps}; run dir {trainer.run_dir} "
        f"(metrics.jsonl, curves.png, memory.png); {trend}"
    )
    return 0
