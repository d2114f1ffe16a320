"""`megarl sft CONFIG [key=value ...]`: validate, read the demonstrations, then fine-tune and export an HF checkpoint."""

import argparse
import shlex
import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "sft",
        help="supervised warm-up on demonstration conversations (JSONL messages), exported as an HF checkpoint",
        description="Validate CONFIG (with key.sub=value overrides) and check every conversation of data.train_files, "
        "then train with the negative log-likelihood of the assistant tokens on a Megatron worker group "
        "(Ray) and write train.output_dir, an HF checkpoint usable as model.path of `megarl train`.",
    )
    parser.add_argument("config", help="SFT recipe YAML (see configs/sft_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. train.total_steps=20")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the recipe and every conversation, print the plan, start nothing",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megarl import credentials, interrupt
    from megarl.cli.stop_signals import StopOnSignal
    from megarl.config.problems import ConfigError
    from megarl.data import DataError
    from megarl.orchestration.cluster import RayStartError, check_ray_can_start
    from megarl.orchestration.placement import PlacementError
    from megarl.orchestration.worker_group import WorkerFailure
    from megarl.run_lock import LOCK_NAME, DirectoryBusy, DirectoryLocks
    from megarl.trainer.sft import SftTrainer

    try:
        trainer = SftTrainer.from_config(args.config, args.overrides)
    except ConfigError as error:
        for problem in error.problems:
            print(f"megarl sft: {problem}", file=sys.stderr)
        return 2
    except DataError as error:
        print(f"megarl sft: {error}", file=sys.stderr)
        return 2
    print(trainer.plan_line(), flush=True)
    if args.dry_run:
        return 0
    out = Path(trainer.config.train.output_dir).expanduser().absolute()
    try:
        check_ray_can_start()
        # Beside train.output_dir, not in it: the export replaces that directory by a rename.
        locks = DirectoryLocks.acquire(
            [("train.output_dir", out, out.parent / f".{out.name}{LOCK_NAME}")],
            shlex.join(["megarl", "sft", args.config, *args.overrides]),
            "megarl sft",
        )
    except (RayStartError, DirectoryBusy) as error:
        print(f"megarl sft: {error}", file=sys.stderr)
        return 1
    # Before Ray starts: no process of the run holds a credential (megarl.credentials).
    credentials.withhold()
    try:
        try:
            with locks, StopOnSignal(lambda: trainer.step_in_progress):
                result = trainer.fit()
        except Exception:
            stopped = interrupt.requested()
            if stopped is None:
                raise
            # A stop signal ended the run (a failure it caused while stopping counts as the stop); fit's
            # clean-up ran: the ranks and Ray are gone.
            where = "start-up or the export" if stopped.where is None else f"step {stopped.where}"
            print(f"megarl sft: stopped by {stopped} during {where}; nothing was exported to {out}", file=sys.stderr)
            return stopped.exit_code
    except ConfigError as error:  # what the running cluster cannot host (train.device: cuda without GPUs)
        for problem in error.problems:
            print(f"megarl sft: {problem}", file=sys.stderr)
        return 2
    except RayStartError as error:
        print(f"megarl sft: {error}", file=sys.stderr)
        return 1
    except (WorkerFailure, PlacementError) as error:
        print(f"megarl sft: failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    last = result.metrics[-1]["loss"] if result.metrics else float("nan")
    print(f"megarl sft: done after {len(result.metrics)} step(s), last loss {last:.4f}; model in {result.output_dir}")
    return 0
