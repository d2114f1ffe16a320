"""`megarl validate CONFIG [key=value ...]`: check a recipe and show what would run, starting nothing.

Prints the resolved config (every key, defaults included), the batch plan, the engines' mode
(`rollout.enforce_eager`, "auto" resolved for the run) and the memory estimate (with a
warning when it does not fit the GPUs: an estimate, so not a refusal), exit 0; or every problem, one line
each, exit 2. Nothing is written and no process, Ray or model is started.
"""

import argparse
import sys

import yaml

from megarl.cli.arguments import positive_float
from megarl.config.batch_plan import plan_batches
from megarl.config.config import to_dict
from megarl.config.engine_compile import validate_lines
from megarl.config.loader import load_config
from megarl.config.memory import kv_cache_problems, rollout_budget_problems
from megarl.config.memory_table import memory_report
from megarl.config.model_facts import ModelFactsError, load_model_dims
from megarl.config.placement import placement_problems
from megarl.config.plan_table import format_plan
from megarl.config.problems import ConfigError, Problem
from megarl.config.validate import validate


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check a config; print the resolved config and the batch plan",
        description="Check a YAML recipe (with key.sub=value overrides) without starting anything. Prints the "
        "resolved config and the batch plan (exit 0) or every problem found (exit 2).",
    )
    parser.add_argument("config", help="YAML recipe, e.g. configs/quickstart.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="overrides applied in order, values parsed as YAML: actor.optim.lr=1e-6 data.train_files=[a.jsonl]",
    )
    parser.add_argument(
        "--no-file-checks",
        action="store_true",
        help="for a recipe meant for another machine: do not look at data files, model/tokenizer/"
        "reward-model directories, checkpoint/output directories or the resume path (the skipped "
        "checks are listed); model-shape checks use megarl's table of known hub models",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=positive_float(),
        default=80.0,
        help="GPU size the per-GPU memory estimate and the colocated engines' "
        "rollout.gpu_memory_utilization are checked against (default 80)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        _report(args.config, error.problems)
        if _is_sft_recipe(args.config, args.overrides):
            print(
                f"({args.config} is a `megarl sft` recipe: check it with `megarl sft {args.config} --dry-run`)",
                file=sys.stderr,
            )
        else:
            print("(semantic checks run once the keys and types above are fixed)", file=sys.stderr)
        return 2
    check_files = not args.no_file_checks
    problems = validate(config, check_files=check_files)
    if not problems:  # the memory estimates need a valid batch plan
        problems = rollout_budget_problems(config, args.gpu_memory_gib) + kv_cache_problems(config, args.gpu_memory_gib)
    if problems:
        _report(args.config, problems)
        return 2
    print("# resolved config")
    print(yaml.dump(to_dict(config), Dumper=_Dumper, sort_keys=False, width=120), end="")
    print("\n# batch plan")
    plan = plan_batches(config)
    print(format_plan(plan))
    print("\n".join(validate_lines(config, plan)))
    print(f"\nmodel: {_model_line(config.model.path)}")
    report, fits = memory_report(config, args.gpu_memory_gib)
    print(f"\n# memory estimate (megarl/config/memory.py)\n{report}")
    if not fits:
        print(
            _red(
                f"warning: the memory estimate above does not fit a {args.gpu_memory_gib:g} GiB GPU: `megarl train` "
                "would likely run out of GPU memory. Shard the model over more GPUs (actor.parallel.*), offload "
                "(actor.offload.*, actor.optim.cpu_offload), or give your GPUs' size with --gpu-memory-gib"
            )
        )
    for device in _devices_left_open(config.trainer.device):
        for problem in placement_problems(config, device):
            print(f"warning: on a {device.upper()} cluster `megarl train` stops with: {problem}")
    if config.rollout.multi_turn.python_tool.unsafe_no_sandbox:
        print(
            _red(
                "warning: rollout.multi_turn.python_tool.unsafe_no_sandbox is true: where this machine cannot "
                "sandbox the python tool, model-written code runs with your rights (your files, other "
                "processes' secrets, the network)"
            )
        )
    if config.reward.sandbox.unsafe_no_sandbox:
        print(
            _red(
                "warning: reward.sandbox.unsafe_no_sandbox is true: where this machine cannot sandbox the "
                "reward's programs, model-written code runs with your rights (your files, other processes' "
                "secrets, the network)"
            )
        )
    if not check_files:
        print(
            "skipped (--no-file-checks): existence of data files, model/tokenizer/reward-model directories (or "
            "their hub ids in the local HF cache) and the resume checkpoint; writability of checkpoint.dir and trainer.output_dir"
        )
    print(f"\n{args.config}: OK" + ("" if fits else ", but see the memory warning above"))
    return 0


def _red(text: str) -> str:
    """`text` in red on a terminal, as is in a pipe or file."""
    return f"\033[31m{text}\033[0m" if sys.stdout.isatty() else text


def _is_sft_recipe(path: str, overrides: list[str]) -> bool:
    """Whether a recipe that is no `megarl train` recipe loads as a `megarl sft` one."""
    from megarl.config.sft import load_sft_config

    try:
        load_sft_config(path, overrides)
    except ConfigError:
        return False
    return True


class _Dumper(yaml.SafeDumper):
    """Block-style sections with flow-style lists: `betas: [0.9, 0.999]`."""


_Dumper.add_representer(
    list, lambda dumper, items: dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=True)
)


def _report(source: str, problems: list[Problem]) -> None:
    print(f"{source}: {len(problems)} problem(s)", file=sys.stderr)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)


def _devices_left_open(setting: str) -> tuple[str, ...]:
    """trainer.device=auto is resolved by the cluster at train time: the devices it may become."""
    return ("cpu", "cuda") if setting == "auto" else ()


def _model_line(path: str) -> str:
    try:
        dims, source = load_model_dims(path)
    except ModelFactsError as error:
        return f"{path}: {error.why}; checks against the model's shape were skipped"
    return (
        f"{path}: {dims.model_type}, {dims.num_layers} layers, {dims.num_attention_heads} heads, "
        f"{dims.num_kv_heads} KV heads (from {source})"
    )
