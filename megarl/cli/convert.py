"""`megarl convert`: HF safetensors ⇄ megarl's Megatron (dist_checkpointing) model checkpoint, and a
training checkpoint's actor (any `step_<N>` of a run) to HF safetensors.

    megarl convert hf-to-mcore --hf DIR --out DIR --tp 2 --pp 2
    megarl convert hf-to-mcore --hf MOE_DIR --out DIR --ep 2          # mixture of experts: each rank its experts
    megarl convert mcore-to-hf --ckpt DIR --out DIR
    megarl convert mcore-to-hf --ckpt CKPT_DIR/step_00000040 --hf MODEL_PATH --out DIR

Inputs are validated before any process starts (exit 2); the conversion runs in local gloo processes
spawned here, PP × lcm(TP, expert TP × EP) of them (TP × PP for a dense model), so it works on a laptop.
Outputs appear complete or not at all.
"""

from __future__ import annotations

import argparse
import functools
import math
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from megarl.cli.arguments import output_dir_problem
from megarl.config.hub import cached_snapshot, download_command, is_hub_id
from megarl.models.hf_checkpoint import check_hf_checkpoint, copy_hf_assets
from megarl.models.hf_config import check_parallel_layout, load_hf_config, read_model_dims
from megarl.workers.training_export import check_actor_checkpoint, is_training_checkpoint


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert model weights between HF safetensors and megarl's Megatron checkpoint",
        description="Convert model weights between HF safetensors and megarl's Megatron (torch_dist) checkpoint.",
    )
    directions = parser.add_subparsers(title="direction", metavar="DIRECTION", required=True)
    to_mcore = directions.add_parser("hf-to-mcore", help="HF checkpoint dir -> Megatron checkpoint at TP x PP")
    to_mcore.add_argument("--hf", required=True, type=Path, help="HF checkpoint dir (config.json, *.safetensors)")
    to_mcore.add_argument("--out", required=True, type=Path, help="new Megatron checkpoint dir (must not exist)")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    _add_expert_arguments(to_mcore, "")
    to_mcore.add_argument(
        "--vocab-divisible-by", type=int, default=128, help="pad the vocab to a multiple of this x TP (default: 128)"
    )
    to_mcore.set_defaults(func=run, direction="hf-to-mcore")
    to_hf = directions.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF checkpoint dir")
    to_hf.add_argument(
        "--ckpt",
        required=True,
        type=Path,
        help="megarl Megatron checkpoint dir (hf-to-mcore output), or a training checkpoint's step_<N> dir",
    )
    to_hf.add_argument(
        "--hf",
        type=Path,
        default=None,
        help="with a training checkpoint: the run's model.path, a directory or a cached hub id "
        "(config.json and tokenizer are copied)",
    )
    to_hf.add_argument("--out", required=True, type=Path, help="new HF checkpoint dir (must not exist)")
    to_hf.add_argument("--tp", type=int, default=1, help="tensor-parallel size used to read it (default: 1)")
    to_hf.add_argument("--pp", type=int, default=1, help="pipeline-parallel size used to read it (default: 1)")
    _add_expert_arguments(to_hf, " used to read it")
    to_hf.set_defaults(func=run, direction="mcore-to-hf")


def _add_expert_arguments(parser: argparse.ArgumentParser, use: str) -> None:
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help=f"expert-parallel size{use}: each rank holds num_experts / EP experts (default: 1)",
    )
    parser.add_argument(
        "--etp", type=int, default=None, help=f"tensor-parallel size of each expert{use} (default: --tp)"
    )


def ranks_of(args: argparse.Namespace) -> int:
    """The processes a conversion runs in: PP × the smallest stage that holds both grids, TP × DP and
    expert TP × EP × expert DP (megatron's dense and expert grids over the same ranks)."""
    return args.pp * math.lcm(args.tp, (args.etp or args.tp) * args.ep)


def _layout(args: argparse.Namespace) -> dict[str, int | None]:
    return dict(tp_size=args.tp, pp_size=args.pp, ep_size=args.ep, etp_size=args.etp)


def run(args: argparse.Namespace) -> int:
    # Megatron and the process machinery load only after the arguments are known to be usable.
    try:
        _check_args(args)
        job = _checked_job(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"megarl convert {args.direction}: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    from megarl.cli.stop_signals import StopOnSignal
    from megarl.interrupt import Stopped
    from megarl.parallel.spawn import DistributedFailure, run_distributed

    try:
        with StopOnSignal(lambda: None):
            job(run_distributed)
    except DistributedFailure as e:
        print(f"megarl convert {args.direction}: failed: {e}", file=sys.stderr)
        return 1
    except Stopped as stopped:  # the ranks are killed and the partial output removed on the way here
        print(
            f"megarl convert {args.direction}: stopped by {stopped}; nothing was written to {args.out}", file=sys.stderr
        )
        return stopped.exit_code
    print(f"wrote {args.out}")
    return 0


def _checked_job(args: argparse.Namespace) -> Callable[[Callable], None]:
    """The conversion to run (given `run_distributed`), once its input is checked."""
    if args.direction == "hf-to-mcore":
        check_hf_checkpoint(args.hf, **_layout(args))
        return functools.partial(_hf_to_mcore, args)
    ranks = ranks_of(args)
    if is_training_checkpoint(args.ckpt):
        hf_dir = _model_dir(args.hf)
        actor = check_actor_checkpoint(args.ckpt, hf_dir)
        check_parallel_layout(read_model_dims(hf_dir), **_layout(args))
        vocab_divisible_by = actor.vocab_divisible_by_at(args.tp)
        return lambda run_distributed: run_distributed(
            _training_to_hf_rank,
            ranks,
            str(args.ckpt),
            str(hf_dir),
            str(args.out),
            _grid(args),
            actor.dtype,
            vocab_divisible_by,
        )
    _check_mcore_checkpoint(args)
    return lambda run_distributed: run_distributed(_mcore_to_hf_rank, ranks, str(args.ckpt), str(args.out), _grid(args))


def _grid(args: argparse.Namespace) -> tuple[int, int, int, int | None]:
    """(TP, PP, EP, expert TP): what each rank builds its process groups of."""
    return args.tp, args.pp, args.ep, args.etp


def _check_args(args: argparse.Namespace) -> None:
    for flag in ("tp", "pp", "ep", "etp", "vocab_divisible_by"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.out.exists():
        raise ValueError(f"--out {args.out} already exists: remove it or choose another directory")
    problem = output_dir_problem(args.out, overwrite=False)  # here only whether it can be made
    if problem is not None:
        raise ValueError(problem)


def _check_mcore_checkpoint(args: argparse.Namespace) -> None:
    from megarl.models.mcore_checkpoint import read_info

    info = read_info(args.ckpt)
    if args.hf is not None:
        raise ValueError(
            f"--hf is for training checkpoints; {args.ckpt} carries its HF config and tokenizer: leave --hf out"
        )
    check_parallel_layout(read_model_dims(info.hf_config), **_layout(args))
    info.vocab_divisible_by_at(args.tp)


def _model_dir(hf: Path | None) -> Path | None:
    """`--hf` as a directory: a hub id (the run's model.path may be one) is its snapshot in the local HF cache."""
    if hf is None or not is_hub_id(str(hf)):
        return hf
    snapshot = cached_snapshot(str(hf))
    if snapshot is None:
        raise ValueError(
            f"--hf {hf} is not in the local HF cache: run `{download_command(str(hf))}`, or pass the model's directory"
        )
    return snapshot


def _hf_to_mcore(args: argparse.Namespace, run_distributed) -> None:
    from megarl.models.mcore_checkpoint import ASSETS_DIR, FORMAT, MODEL_DIR, McoreCheckpointInfo, write_info

    tmp = args.out.parent / f".{args.out.name}.tmp-{uuid.uuid4().hex[:8]}"
    (tmp / MODEL_DIR).mkdir(parents=True)
    try:
        run_distributed(
            _hf_to_mcore_rank,
            ranks_of(args),
            str(args.hf),
            str(tmp / MODEL_DIR),
            _grid(args),
            args.vocab_divisible_by,
        )
        (tmp / ASSETS_DIR).mkdir()
        copy_hf_assets(args.hf, tmp / ASSETS_DIR)
        info = McoreCheckpointInfo(
            format=FORMAT,
            tp_size=args.tp,
            pp_size=args.pp,
            vocab_divisible_by=args.vocab_divisible_by,
            hf_config=load_hf_config(args.hf),
        )
        write_info(tmp, info)
        tmp.rename(args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _hf_to_mcore_rank(hf_dir: str, model_dir: str, grid: tuple, vocab_divisible_by: int) -> None:
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.models.mcore_checkpoint import save_model_shards

    groups = _groups(grid)
    model = build_gpt_model(hf_dir, groups, vocab_divisible_by=vocab_divisible_by)
    load_hf_weights(model, hf_dir, groups, vocab_divisible_by=vocab_divisible_by)
    save_model_shards(model, model_dir)


def _groups(grid: tuple):
    """This rank's process groups of a (TP, PP, EP, expert TP) grid."""
    from megarl.parallel.distributed import initialize_model_parallel

    tp, pp, ep, etp = grid
    return initialize_model_parallel(tp, pp, seed=0, ep=ep, etp=etp)


def _mcore_to_hf_rank(ckpt_dir: str, out_dir: str, grid: tuple) -> None:
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import export_hf_weights
    from megarl.models.mcore_checkpoint import ASSETS_DIR, MODEL_DIR, load_model_shards, read_info

    info = read_info(ckpt_dir)
    assets = Path(ckpt_dir) / ASSETS_DIR
    groups = _groups(grid)
    model = build_gpt_model(assets, groups, vocab_divisible_by=info.vocab_divisible_by_at(groups.tp_size))
    load_model_shards(model, Path(ckpt_dir) / MODEL_DIR)
    export_hf_weights(model, out_dir, groups, hf_assets_dir=assets)


def _training_to_hf_rank(
    step_dir: str, hf_dir: str, out_dir: str, grid: tuple, dtype: str, vocab_divisible_by: int
) -> None:
    """The actor of a training checkpoint, loaded at `grid` in its saved dtype, written as HF safetensors."""
    import torch

    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import export_hf_weights
    from megarl.workers.checkpoint import load_checkpoint
    from megarl.workers.training_export import ACTOR

    groups = _groups(grid)
    model = build_gpt_model(hf_dir, groups, params_dtype=getattr(torch, dtype), vocab_divisible_by=vocab_divisible_by)
    load_checkpoint(step_dir, groups, models={ACTOR: [model]}, optimizers={}, schedulers={}, weights_only=True)
    export_hf_weights(model, out_dir, groups, hf_assets_dir=hf_dir)
