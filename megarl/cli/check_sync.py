"""`megarl check-sync`: run the whole weight-sync path on a model and check it, exactly and by the log-prob gap.

Spawns the training ranks (Megatron actor of --train-tp × --train-pp, and for a mixture of experts
--train-ep × --train-etp, loaded from the HF checkpoint),
trains them a few optimizer steps per round so the sync really changes the weights, syncs into a
vLLM engine of --rollout-tp (over --transport), then checks every tensor the engine's workers loaded
against the actor's own shards bit for bit (the trainer's exact sync check, naming any tensor that
differs) and compares the engine's prompt log-probs with the actor's (both fp32). Exit 0 when every
round loads every tensor exactly and is within --threshold, 1 otherwise.

On GPUs only --transport in-process runs: with the collective the training ranks take GPUs 0, 1, ...
(their LOCAL_RANK) and the engine in this process takes GPUs 0, 1, ... too (vLLM's first visible
devices), so training rank 0 and engine worker 0 would share GPU 0 in one NCCL sync group, which NCCL
refuses (the trainer's rule: `megarl.config.placement`'s `_collective_on_shared_gpus`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.cli.arguments import positive_float
from megarl.config.rollout import LOGPROB_GAP_BY_DTYPE

THRESHOLD = LOGPROB_GAP_BY_DTYPE[("float32", "float32")]
"""The trainer's `auto` threshold for fp32, the dtype of this check (`workers.sync_check.ENGINE_DTYPE`)."""
TRANSPORTS = ("collective", "in-process")
MAX_BUCKET_MB = 1024 * 1024
"""1 TiB: a bucket is one buffer in memory, so anything larger is a typo (the whole model in one bucket is far less)."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check-sync",
        help="sync a Megatron actor's weights into vLLM and check the log-prob gap",
        description=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--model", required=True, type=Path, help="HF checkpoint dir (config.json + safetensors)")
    parser.add_argument("--train-tp", type=int, default=1, help="Megatron tensor-parallel size (default: 1)")
    parser.add_argument("--train-pp", type=int, default=1, help="Megatron pipeline-parallel size (default: 1)")
    parser.add_argument(
        "--train-vpp",
        type=int,
        default=1,
        help="Megatron virtual pipeline stages per PP rank, the interleaved schedule (default: 1, none)",
    )
    parser.add_argument(
        "--train-ep",
        type=int,
        default=1,
        help="Megatron expert-parallel size, a mixture-of-experts model only; the trainer world grows to "
        "the fewest ranks the layout fits (default: 1)",
    )
    parser.add_argument(
        "--train-etp",
        type=int,
        default=None,
        help="Megatron expert-tensor-parallel size, a mixture-of-experts model only (default: --train-tp)",
    )
    parser.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor-parallel size (default: 1)")
    parser.add_argument(
        "--threshold",
        type=positive_float(),
        default=THRESHOLD,
        help=f"max allowed |log-prob gap| (default: {THRESHOLD:g})",
    )
    parser.add_argument(
        "--bucket-mb", type=positive_float(MAX_BUCKET_MB), default=64, help="bucket size in MiB (default: 64)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="train-then-sync rounds (default: 2)")
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="collective",
        help="collective: an engine in this process; every training rank sends its shards over a gloo "
        "group to the engine's workers (CPU only); in-process: a TP-1 engine inside each training rank's "
        "process (colocated, CPU or GPU) (default: collective)",
    )
    parser.set_defaults(func=run)


def _problems(args: argparse.Namespace) -> list[str]:
    from megarl.bridge.plan import check_layout
    from megarl.models.hf_config import read_model_dims
    from megarl.parallel.device import uses_cuda

    problems = [
        f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1"
        for name in ("train_tp", "train_pp", "train_vpp", "train_ep", "train_etp", "rollout_tp", "rounds")
        if getattr(args, name) is not None and getattr(args, name) < 1
    ]
    if args.transport == "in-process" and (args.train_ep > 1 or args.train_etp not in (None, args.train_tp)):
        problems.append(
            f"--train-ep {args.train_ep} / --train-etp {args.train_etp} with --transport in-process: the colocated "
            "check gathers full tensors over TP only; use --transport collective, whose shard sync sends each "
            "expert from the rank holding it"
        )
    if args.transport == "in-process" and args.rollout_tp != 1:
        problems.append(
            f"--rollout-tp {args.rollout_tp} with --transport in-process: a colocated engine runs in one trainer "
            "process (TP 1); use --transport collective for rollout TP > 1"
        )
    if args.transport == "collective" and uses_cuda():
        problems.append(
            "--transport collective on GPUs: training rank 0 and the rollout engine's worker 0 would both use GPU 0 "
            "in one NCCL sync group (the training ranks take GPUs 0, 1, ..., the engine in this process too), "
            "which NCCL refuses; use --transport in-process (a TP-1 engine in each training rank's process, on "
            "its own GPU, no NCCL group), or run the collective check on CPU: CUDA_VISIBLE_DEVICES= megarl check-sync ..."
        )
    try:
        dims = read_model_dims(args.model)
    except (OSError, ValueError) as error:
        return problems + [f"--model {args.model}: {error}"]
    if not problems:
        try:
            check_layout(dims, _layout(args))
        except ValueError as error:
            problems.append(str(error))
    return problems


def _layout(args: argparse.Namespace):
    from megarl.bridge.plan import LayoutPair

    return LayoutPair(
        args.train_tp, args.train_pp, args.rollout_tp, args.train_vpp, train_ep=args.train_ep, train_etp=args.train_etp
    )


def run(args: argparse.Namespace) -> int:
    problems = _problems(args)
    if problems:
        for problem in problems:
            print(f"megarl check-sync: error: {problem}", file=sys.stderr)
        return 2
    from megarl.bridge.verify import SyncVerificationError

    try:
        rounds = _run_check(args)
    except SyncVerificationError as error:
        print(f"megarl check-sync: FAILED: {error}", file=sys.stderr)
        return 1
    for i, result in enumerate(rounds, 1):
        gap = result.metrics[args.rollout_tp]
        sync = result.sync_metrics
        print(
            f"round {i}: {_layout(args)}: "
            f"log-prob gap max {gap['sync/logprob_max_abs_diff']:.3g} mean {gap['sync/logprob_mean_abs_diff']:.3g} "
            f"(threshold {args.threshold:g}); {int(gap['sync/checksum_tensors'])} tensors loaded bit for bit; "
            f"sync {sync['sync/seconds']:.3f} s, {int(sync['sync/buckets'])} buckets, "
            f"{sync['sync/gigabytes'] * 1e3:.1f} MB"
        )
    print("OK")
    return 0


def _run_check(args: argparse.Namespace):
    """The rounds of the check (of training rank 0's engine for --transport in-process)."""
    from megarl.workers.rollout import make_rollout_engine
    from megarl.workers.rollout.engine_args import EngineArgs
    from megarl.workers.sync_check import run_colocated_check, run_sync_check

    common = dict(
        train_tp=args.train_tp,
        train_pp=args.train_pp,
        train_vpp=args.train_vpp,
        threshold=args.threshold,
        rounds=args.rounds,
        bucket_mb=args.bucket_mb,
    )
    if args.transport == "in-process":
        return run_colocated_check(args.model, backend="vllm", **common)[0]
    engine = make_rollout_engine("vllm", EngineArgs(args.model, tensor_parallel_size=args.rollout_tp, dtype="float32"))
    try:
        return run_sync_check(
            args.model, engines={args.rollout_tp: engine}, train_ep=args.train_ep, train_etp=args.train_etp, **common
        )
    finally:
        engine.shutdown()
