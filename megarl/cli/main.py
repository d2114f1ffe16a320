"""`megarl` entry point: dispatches to one module per sub-command.

Each module in COMMANDS defines `register(subparsers)` (adds its parser, sets `func=run`) and
`run(args) -> int` (the exit code: 0 ok, 1 runtime failure, 2 bad input).
"""

import argparse
import importlib
import sys

from megarl import quiet
from megarl.cli.version import VersionAction

COMMANDS: list[str] = ["init_tiny_model", "make_data", "validate", "train", "sft", "convert", "check_sync", "check_manifests",
                       "plot", "bench"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl",
        description="Megatron-first RL post-training for LLMs (GRPO, PPO, DAPO) on megatron-core, vLLM and Ray.",
    )
    parser.add_argument("--version", action=VersionAction,
                        help="print megarl's version and the installed torch, megatron-core, vLLM, TE, Ray versions")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
