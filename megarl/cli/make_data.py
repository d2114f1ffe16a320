"""`megarl make-data`: write prompt files, from a public dataset (gsm8k, math, jsonl) or a synthetic task.

    megarl make-data gsm8k --source openai/gsm8k --subset main --model Qwen/Qwen2.5-0.5B-Instruct --out data/gsm8k
    megarl make-data math --source hendrycks_math/train.parquet --model Qwen/Qwen2.5-7B-Instruct --out data/math
    megarl make-data jsonl --source qa.jsonl --prompt-column q --answer-column a --model MODEL --out data/qa
    megarl make-data --task repeat_first_char --out outputs/quickstart-data

A dataset gives OUT/train.parquet, OUT/test.parquet and OUT/summary.json (`megarl.data.prepare`); a
synthetic task gives OUT/train.jsonl and OUT/val.jsonl (`megarl.rewards.tasks`).
"""

import argparse
import json
import random
import sys
from functools import partial
from pathlib import Path

from megarl import interrupt
from megarl.cli.arguments import output_dir_problem, positive_float
from megarl.rewards.tasks import TASKS

DATASETS = ("gsm8k", "math", "jsonl")
"""Public-dataset conventions (`megarl.data.conventions`); `jsonl` is any dataset with the columns named."""
_DATASET_FLAGS = (
    "source",
    "subset",
    "model",
    "prompt_format",
    "test_fraction",
    "instruction",
    "prompt_column",
    "answer_column",
)
_TASK_FLAGS = ("n_train", "n_val")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "make-data",
        help="write prompt files from a public dataset (gsm8k, math, jsonl) or a synthetic task",
        description="From a dataset in its own schema (an HF hub id in the local cache, a dataset directory, or a "
        ".parquet/.jsonl file): OUT/train.parquet, OUT/test.parquet and OUT/summary.json with verl's "
        "GSM8K/MATH conventions. From a synthetic task (--task): OUT/train.jsonl and OUT/val.jsonl.",
    )
    parser.add_argument(
        "dataset",
        nargs="?",
        choices=DATASETS,
        help="gsm8k (question, answer with '#### N'), math (problem, solution with \\boxed{}), or "
        "jsonl (any columns, named by --prompt-column/--answer-column)",
    )
    parser.add_argument("--task", choices=sorted(TASKS), help="a synthetic task instead of a dataset")
    parser.add_argument(
        "--out", required=True, type=Path, help="output directory (created; must be empty unless --overwrite)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out, replacing the files this command writes there",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the task generator or of the test cut (default: 0)"
    )
    dataset = parser.add_argument_group("datasets")
    dataset.add_argument(
        "--source",
        help="hub id in the local HF cache (openai/gsm8k), dataset directory, or "
        ".parquet/.jsonl file in the dataset's own schema",
    )
    dataset.add_argument("--subset", help="the dataset's subset (config), e.g. main for openai/gsm8k")
    dataset.add_argument(
        "--model",
        help="model directory or cached hub id: its tokenizer measures the prompts and its chat template formats them",
    )
    dataset.add_argument(
        "--prompt-format",
        choices=("chat", "raw"),
        help="chat (default): chat messages, for instruct models; raw: plain text, for base models "
        "(the recipe then sets data.chat_template: false)",
    )
    dataset.add_argument(
        "--test-fraction",
        type=positive_float(1.0),
        help="share of a single-split dataset held out as test (default: 0.1); a dataset with "
        "train and test splits keeps its own",
    )
    dataset.add_argument(
        "--instruction",
        help="text appended to each question after a space (default: the "
        "dataset's, e.g. GSM8K's '####' instruction; '' for none)",
    )
    dataset.add_argument("--prompt-column", help="jsonl: the question column (default: prompt)")
    dataset.add_argument("--answer-column", help="jsonl: the reference answer column (default: answer)")
    task = parser.add_argument_group("synthetic tasks")
    task.add_argument("--n-train", type=int, help="training prompts (default: 2048)")
    task.add_argument("--n-val", type=int, help="validation prompts (default: 128)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problem = _mode_problem(args) or output_dir_problem(args.out, overwrite=args.overwrite)
    if problem is not None:
        return _error(problem)
    from megarl.cli.stop_signals import StopOnSignal
    from megarl.interrupt import Stopped

    try:  # a stop is taken until the files are written (each whole: `write_whole`), not while they are
        with StopOnSignal(lambda: None):
            return _run_task(args) if args.task else _run_dataset(args)
    except Stopped as stopped:
        print(f"megarl make-data: stopped by {stopped}; nothing was written to {args.out}", file=sys.stderr)
        return stopped.exit_code


def _mode_problem(args: argparse.Namespace) -> str | None:
    """Why the flags do not make one command (None if they do)."""
    if (args.dataset is None) == (args.task is None):
        return f"name a dataset ({', '.join(DATASETS)}) or a synthetic --task, one of the two"
    wrong = _TASK_FLAGS if args.dataset else _DATASET_FLAGS
    given = [f"--{name.replace('_', '-')}" for name in wrong if getattr(args, name) is not None]
    if given:
        used = f"the dataset {args.dataset}" if args.dataset else f"--task {args.task}"
        return f"{', '.join(given)} do(es) not apply to {used}; leave it out"
    if args.task:
        return None
    missing = [f"--{name}" for name in ("source", "model") if getattr(args, name) is None]
    if missing:
        return f"the dataset {args.dataset} needs {' and '.join(missing)}, e.g. --source openai/gsm8k --model Qwen/Qwen2.5-0.5B-Instruct"
    if args.dataset != "jsonl" and (args.prompt_column or args.answer_column):
        return (
            f"{args.dataset} has fixed columns; --prompt-column/--answer-column apply to jsonl "
            f"(`megarl make-data jsonl ...` for another schema)"
        )
    return None


def _run_task(args: argparse.Namespace) -> int:
    n_train = 2048 if args.n_train is None else args.n_train
    n_val = 128 if args.n_val is None else args.n_val
    if n_train < 1 or n_val < 1:
        return _error(f"need --n-train >= 1 and --n-val >= 1, got {n_train} and {n_val}")
    try:
        rows = TASKS[args.task](n_train + n_val, random.Random(args.seed))
    except ValueError as error:
        return _error(f"{error}; lower --n-train/--n-val")
    from megarl.data.prepare import write_whole

    interrupt.check()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[:n_train]), ("val", rows[n_train:])):
        path = args.out / f"{name}.jsonl"
        write_whole(path, lambda target, part=part: target.write_text("".join(json.dumps(row) + "\n" for row in part)))
        print(f"wrote {path} ({len(part)} rows)")
    return 0


def _run_dataset(args: argparse.Namespace) -> int:
    from megarl.data.conventions import CONVENTIONS, SchemaError, check_columns, generic_convention
    from megarl.data.dataset_source import SourceError, load_splits
    from megarl.data.files import DataError
    from megarl.data.prepare import PrepareError, format_summary, prepare_split, summarize, write_outputs
    from megarl.data.template import PromptRenderer

    if args.dataset == "jsonl":
        convention = generic_convention(
            args.prompt_column or "prompt", args.answer_column or "answer", args.instruction
        )
    else:
        convention = CONVENTIONS[args.dataset](args.instruction)
    prompt_format = args.prompt_format or "chat"
    try:
        tokenizer = _tokenizer(args.model, prompt_format)
        train, test = load_splits(
            args.source, args.subset, args.test_fraction or 0.1, args.seed, partial(check_columns, convention)
        )
        renderer = PromptRenderer(tokenizer, prompt_format == "chat")
        splits = [
            prepare_split(name, split, convention, renderer, args.source)
            for name, split in (("train", train), ("test", test))
        ]
    except (SourceError, SchemaError, PrepareError, DataError, _ModelError) as error:
        return _error(str(error))
    inputs = {"source": args.source, "subset": args.subset, "model": args.model, "prompt_format": prompt_format}
    summary = summarize(splits, convention, args.out, prompt_format == "chat", inputs)
    interrupt.check()
    write_outputs(args.out, splits, summary)
    print(format_summary(summary))
    print(f"summary: {args.out / 'summary.json'}")
    return 0


class _ModelError(ValueError):
    """--model gives no usable tokenizer."""


def _tokenizer(model: str, prompt_format: str):
    from transformers import AutoTokenizer

    from megarl.config.hub import cached_snapshot, download_command, is_hub_id

    path = cached_snapshot(model) if is_hub_id(model) else Path(model).expanduser()
    if path is None:
        raise _ModelError(
            f"--model {model}: a hub id that is not in the local Hugging Face cache; download it first "
            f"(`{download_command(model)}`) or give a model directory"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise _ModelError(
            f"--model {model}: no tokenizer loads from it ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0]}); give the model's checkpoint directory"
        ) from None
    if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise _ModelError(
            f"--model {model}: its tokenizer has no chat template, so chat prompts cannot be formatted; "
            "for a base model pass --prompt-format raw (and set data.chat_template: false in the recipe)"
        )
    return tokenizer


def _error(message: str) -> int:
    print(f"megarl make-data: error: {message}", file=sys.stderr)
    return 2
