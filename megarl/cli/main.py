"""`megarl` entry point: dispatches to one module per sub-command.

Each module in COMMANDS defines `register(subparsers)` (adds its parser, sets `func=run`) and
`run(args) -> int` (the exit code: 0 ok, 1 runtime failure, 2 bad input).
"""

import argparse
import importlib
import io
import os
import sys

from megarl import quiet
from megarl.cli.version import VersionAction

COMMANDS: list[str] = [
    "init_tiny_model",
    "make_data",
    "validate",
    "train",
    "sft",
    "convert",
    "check_sync",
    "check_manifests",
    "plot",
    "bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl",
        description="Megatron-first RL post-training for LLMs (GRPO, PPO, DAPO) on megatron-core, vLLM and Ray.",
    )
    parser.add_argument(
        "--version",
        action=VersionAction,
        help="print megarl's version and the installed torch, megatron-core, vLLM, TE, Ray versions",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    for name in COMMANDS:
        importlib.import_module(f"megarl.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # The driver computes nothing: the CUDA advice, where it applies, comes from the ranks that do.
    quiet.install(cuda_advice=False)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    # What the machine refuses (a closed pipe, a full disk, a path it will not write, memory) ends any
    # command with one line naming it, exit 1: the commands report bad input themselves (exit 2).
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader gone while the output waited in the buffer shows here, not at exit
        return code
    except BrokenPipeError:
        _discard_stdout()
        print(
            f"megarl {args.command}: the output's reader closed the pipe (e.g. `| head`); the rest of the "
            "output was dropped",
            file=sys.stderr,
        )
        return 1
    except OSError as error:
        print(f"megarl {args.command}: {environment_failure(error)}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"megarl {args.command}: out of memory; fix: free memory or use smaller sizes", file=sys.stderr)
        return 1


def environment_failure(error: OSError) -> str:
    """One line for an OSError: what failed, on which path, and where to look."""
    if error.filename is None:
        return f"failed: {error}; fix: check the machine's resources (disk space, open files, network) and run again"
    return (
        f"cannot use {error.filename}: {error.strerror or error}; fix: check that path (its permissions, the "
        "free space of its file system) or choose another"
    )


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush at exit does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # no file descriptor behind stdout (a test's capture): nothing flushes it at exit


if __name__ == "__main__":
    sys.exit(main())
