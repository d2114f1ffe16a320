"""`megarl convert`: HF safetensors ⇄ megarl's Megatron (dist_checkpointing) model checkpoint.

    megarl convert hf-to-mcore --hf DIR --out DIR --tp 2 --pp 2
    megarl convert mcore-to-hf --ckpt DIR --out DIR

Inputs are validated before any process starts (exit 2); the conversion runs in TP × PP local gloo
processes spawned here, so it works on a laptop. Outputs appear complete or not at all.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import uuid
from pathlib import Path

from megarl.cli.arguments import output_dir_problem
from megarl.models.hf_checkpoint import check_hf_checkpoint, copy_hf_assets
from megarl.models.hf_config import check_parallel_layout, load_hf_config, read_model_dims


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
    to_mcore.add_argument(
        "--vocab-divisible-by", type=int, default=128, help="pad the vocab to a multiple of this x TP (default: 128)"
    )
    to_mcore.set_defaults(func=run, direction="hf-to-mcore")
    to_hf = directions.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF checkpoint dir")
    to_hf.add_argument("--ckpt", required=True, type=Path, help="megarl Megatron checkpoint dir (hf-to-mcore output)")
    to_hf.add_argument("--out", required=True, type=Path, help="new HF checkpoint dir (must not exist)")
    to_hf.add_argument("--tp", type=int, default=1, help="tensor-parallel size used to read it (default: 1)")
    to_hf.add_argument("--pp", type=int, default=1, help="pipeline-parallel size used to read it (default: 1)")
    to_hf.set_defaults(func=run, direction="mcore-to-hf")


def run(args: argparse.Namespace) -> int:
    # Megatron and the process machinery load only after the arguments are known to be usable.
    try:
        _check_args(args)
        if args.direction == "hf-to-mcore":
            check_hf_checkpoint(args.hf, tp_size=args.tp, pp_size=args.pp)
        else:
            _check_mcore_checkpoint(args.ckpt, args.tp, args.pp)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"megarl convert {args.direction}: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    from megarl.parallel.spawn import DistributedFailure, run_distributed

    try:
        if args.direction == "hf-to-mcore":
            _hf_to_mcore(args, run_distributed)
        else:
            run_distributed(_mcore_to_hf_rank, args.tp * args.pp, str(args.ckpt), str(args.out), args.tp, args.pp)
    except DistributedFailure as e:
        print(f"megarl convert {args.direction}: failed: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    for flag in ("tp", "pp", "vocab_divisible_by"):
        if getattr(args, flag, 1) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.out.exists():
        raise ValueError(f"--out {args.out} already exists: remove it or choose another directory")
    problem = output_dir_problem(args.out, overwrite=False)  # here only whether it can be made
    if problem is not None:
        raise ValueError(problem)


def _check_mcore_checkpoint(ckpt_dir: Path, tp: int, pp: int) -> None:
    from megarl.models.mcore_checkpoint import read_info

    info = read_info(ckpt_dir)
    check_parallel_layout(read_model_dims(info.hf_config), tp_size=tp, pp_size=pp)
    info.vocab_divisible_by_at(tp)


def _hf_to_mcore(args: argparse.Namespace, run_distributed) -> None:
    from megarl.models.mcore_checkpoint import ASSETS_DIR, FORMAT, MODEL_DIR, McoreCheckpointInfo, write_info

    tmp = args.out.parent / f".{args.out.name}.tmp-{uuid.uuid4().hex[:8]}"
    (tmp / MODEL_DIR).mkdir(parents=True)
    try:
        run_distributed(
            _hf_to_mcore_rank, args.tp * args.pp, str(args.hf), str(tmp / MODEL_DIR), args.tp, args.pp,
            args.vocab_divisible_by,
        )
        (tmp / ASSETS_DIR).mkdir()
        copy_hf_assets(args.hf, tmp / ASSETS_DIR)
        info = McoreCheckpointInfo(
            format=FORMAT, tp_size=args.tp, pp_size=args.pp, vocab_divisible_by=args.vocab_divisible_by,
            hf_config=load_hf_config(args.hf),
        )
        write_info(tmp, info)
        tmp.rename(args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _hf_to_mcore_rank(hf_dir: str, model_dir: str, tp: int, pp: int, vocab_divisible_by: int) -> None:
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.models.mcore_checkpoint import save_model_shards
    from megarl.parallel.distributed import initialize_model_parallel

    groups = initialize_model_parallel(tp, pp, seed=0)
    model = build_gpt_model(hf_dir, groups, vocab_divisible_by=vocab_divisible_by)
    load_hf_weights(model, hf_dir, groups, vocab_divisible_by=vocab_divisible_by)
    save_model_shards(model, model_dir)


def _mcore_to_hf_rank(ckpt_dir: str, out_dir: str, tp: int, pp: int) -> None:
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import export_hf_weights
    from megarl.models.mcore_checkpoint import ASSETS_DIR, MODEL_DIR, load_model_shards, read_info
    from megarl.parallel.distributed import initialize_model_parallel

    info = read_info(ckpt_dir)
    assets = Path(ckpt_dir) / ASSETS_DIR
    groups = initialize_model_parallel(tp, pp, seed=0)
    model = build_gpt_model(assets, groups, vocab_divisible_by=info.vocab_divisible_by_at(tp))
    load_model_shards(model, Path(ckpt_dir) / MODEL_DIR)
    export_hf_weights(model, out_dir, groups, hf_assets_dir=assets)
