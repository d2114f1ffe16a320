"""`megarl make-data`: write a synthetic task's prompt files (train.jsonl, val.jsonl) for the quickstart and tests."""

import argparse
import json
import random
import sys
from pathlib import Path

from megarl.cli.arguments import output_dir_problem
from megarl.rewards.tasks import TASKS


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "make-data",
        help="write a synthetic task's train.jsonl and val.jsonl (prompts and answers, or demonstrations for sft)",
        description="Write OUT/train.jsonl and OUT/val.jsonl for a synthetic task (megarl.rewards.tasks); "
                    "the two files share no prompt, and the same --seed gives the same files.",
    )
    parser.add_argument("--task", required=True, choices=sorted(TASKS), help="the synthetic task")
    parser.add_argument("--out", required=True, type=Path, help="output directory (created; must be empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out, replacing its train.jsonl and val.jsonl")
    parser.add_argument("--n-train", type=int, default=2048, help="training prompts (default: 2048)")
    parser.add_argument("--n-val", type=int, default=128, help="validation prompts (default: 128)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.n_train < 1 or args.n_val < 1:
        return _error(f"need --n-train >= 1 and --n-val >= 1, got {args.n_train} and {args.n_val}")
    out_problem = output_dir_problem(args.out, overwrite=args.overwrite)
    if out_problem is not None:
        return _error(out_problem)
    try:
        rows = TASKS[args.task](args.n_train + args.n_val, random.Random(args.seed))
    except ValueError as error:
        return _error(f"{error}; lower --n-train/--n-val")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[:args.n_train]), ("val", rows[args.n_train:])):
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in part))
        print(f"wrote {path} ({len(part)} rows)")
    return 0


def _error(message: str) -> int:
    print(f"megarl make-data: error: {message}", file=sys.stderr)
    return 2
