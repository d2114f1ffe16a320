"""`megarl bench {sync,rollout,train,step}`: side-by-side benchmarks of megarl's phases (step --modes:
placements and rollout modes side by side).

Each prints a markdown table and, with --json, writes the full result (every repeat, the model's
shape, the batch shapes, package versions). Figures are ratios of contenders timed in turn in the
same run, medians of --repeats after a warm-up; on a shared machine absolute times vary a lot,
the ratios much less.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import tempfile
from pathlib import Path

from megarl.cli.arguments import output_file_problem

BENCHMARKS = ("sync", "rollout", "train", "step")
PEERS = ("trl",)
BENCH_MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
"""The default model when --model is not given: a 4-layer Qwen2, ~3 M parameters (sync: `bench.sync.MODEL_100M`,
100.9 M; --smoke: the tiny default)."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark a phase against its plain baseline (ratios, JSON)",
        description=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "benchmark",
        choices=BENCHMARKS,
        help="sync: weight sync vs clone and vs raw broadcast; rollout: megarl vs vLLM vs HF "
        "generate; train: Megatron update vs plain PyTorch, TP 2 / PP 2; step: the trainer's "
        "phase breakdown",
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="HF checkpoint dir (default: a 4-layer Qwen2 made on the spot; step: the recipe's model.path)",
    )
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats after the warm-up (default 5)")
    parser.add_argument("--config", default="configs/quickstart.yaml", help="step: the recipe (default quickstart)")
    parser.add_argument(
        "--peer",
        choices=PEERS,
        help="step only: run the same GRPO workload with this other framework too, side by side "
        "(trl: TRL's GRPOTrainer with HF generate and with colocated vLLM; needs the bench "
        "extra) on issue 19's 23.7 M Qwen2, 16 prompts x 8 samples, <= 64 new tokens; "
        "--repeats steps are measured after one warm-up step. Each TRL contender sweeps "
        "its micro-batch (1, 2, 4, 8 accumulation steps) and, with vLLM, eager or compiled "
        "engines; megarl is compared with its fastest run",
    )
    parser.add_argument(
        "--workload",
        choices=("fixed", "variable", "full"),
        default="fixed",
        help="with --peer: response lengths; fixed: EOS ends a response (~49 tokens on average, "
        "issue 19's table); variable: 8 to 64 tokens (~30), EOS and three more stop tokens; "
        "full: every response 64 tokens (generation on equal work)",
    )
    parser.add_argument(
        "--contenders",
        help="with --peer: a comma-separated subset of megarl, megarl_tuned, "
        "megarl_bf16, megarl_call_seeds, trl, trl_vllm, trl_vllm_bf16 (default: all); "
        "e.g. megarl_tuned,trl_vllm with --repeats 40 for the reward curves",
    )
    parser.add_argument(
        "--sweep-megarl",
        action="store_true",
        help="with --peer: each megarl contender also runs at 16 and 64 samples per micro-batch and rank (the "
        "default 32 stays the figure of the ratios); its fastest run is compared with each peer at its best",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="with --peer or --modes: the seed of every run (sampling and prompt order: megarl's trainer.seed, "
        "data.seed and rollout.seed, TRL's seed); the model and prompts stay the same (default 0)",
    )
    parser.add_argument(
        "--modes",
        help="step only: run the recipe in each of these placements and rollout modes in "
        "turn, samples/s and reward first 10 -> last 10 steps side by side: a comma-separated subset of "
        "colocated_sync, split_sync, split_one_step_off, split_async, split_async_partial, split_async_carry "
        "(megarl.bench.step_modes); "
        "with --json X.json the reward curves go to X.png",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --modes: run every mode this many times, the order rotated each round, and pair the ratios by "
        "round (the machine's drift then hits every mode alike; default 1)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model and shapes (train: TP 1 only; rollout: the engine eager, not compiled), to check that a "
        "benchmark runs; the numbers mean nothing",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        print(
            f"megarl bench: --repeats {args.repeats}: must be >= 1 (5 or more for a reported figure)", file=sys.stderr
        )
        return 2
    if args.rounds < 1 or (args.rounds != 1 and args.modes is None):
        print(
            f"megarl bench: --rounds {args.rounds}: rounds of the rollout modes, >= 1, with --modes only "
            "(megarl bench step --modes split_one_step_off,split_async_carry --rounds 3)",
            file=sys.stderr,
        )
        return 2
    if args.peer is not None and args.benchmark != "step":
        print(
            f"megarl bench {args.benchmark}: --peer {args.peer} compares whole steps only; use megarl bench step "
            f"--peer {args.peer}",
            file=sys.stderr,
        )
        return 2
    if args.peer is not None and args.model is not None:
        print(
            f"megarl bench step --peer {args.peer}: --model {args.model}: the comparison makes its own model (the "
            "workload of issue 19); leave --model out",
            file=sys.stderr,
        )
        return 2
    if args.peer is None and (args.workload != "fixed" or args.contenders is not None or args.sweep_megarl):
        print(
            "megarl bench: --workload, --contenders and --sweep-megarl choose the peer comparison's runs; add --peer trl "
            "(megarl bench step --peer trl)",
            file=sys.stderr,
        )
        return 2
    if args.peer is None and args.modes is None and args.seed != 0:
        print(
            "megarl bench: --seed seeds the runs of a comparison; add --peer trl or --modes "
            "(megarl bench step --modes split_sync,split_async --seed 1)",
            file=sys.stderr,
        )
        return 2
    unknown = sorted(set((args.contenders or "").split(",")) - {""} - set(_peer_contenders()))
    if unknown or args.contenders == "":
        print(
            f"megarl bench step --peer: --contenders {args.contenders!r}: unknown {', '.join(unknown) or 'empty list'}; "
            f"choose among {', '.join(_peer_contenders())}",
            file=sys.stderr,
        )
        return 2
    problem = _modes_problem(args)
    if problem:
        print(f"megarl bench: --modes {args.modes!r}: {problem}", file=sys.stderr)
        return 2
    if args.peer == "trl" and importlib.util.find_spec("trl") is None:
        from megarl.bench.trl_peer import MISSING_TRL

        print(MISSING_TRL, file=sys.stderr)
        return 2
    json_problem = None if args.json is None else output_file_problem("--json", args.json)
    if json_problem is not None:  # found now, not after minutes of benchmarking
        print(f"megarl bench: {json_problem}", file=sys.stderr)
        return 2
    if args.model is not None and not (args.model / "config.json").is_file():
        print(
            f"megarl bench: --model {args.model} has no config.json; point it at an HF checkpoint dir", file=sys.stderr
        )
        return 2
    from megarl.bench.common import write_json
    from megarl.cli.stop_signals import StopOnSignal
    from megarl.config.problems import ConfigError
    from megarl.interrupt import Stopped

    try:
        with StopOnSignal(lambda: None), tempfile.TemporaryDirectory(prefix="megarl-bench-") as tmp:
            result, table = _run(args, Path(tmp))
    except ConfigError as error:  # only `step` reads a recipe
        print(f"megarl bench step: {args.config}:\n{error}", file=sys.stderr)
        return 2
    except Stopped as stopped:  # its workers are ended and its scratch directory removed on the way here
        written = f"; nothing was written to {args.json}" if args.json else ""
        print(f"megarl bench {args.benchmark}: stopped by {stopped}{written}", file=sys.stderr)
        return stopped.exit_code
    write_json(args.json, result)
    print(table)
    if args.json:
        print(f"wrote {args.json}")
    if args.json and args.peer is not None:
        from megarl.bench.peer_plot import plot_rewards

        print(f"wrote {plot_rewards(result, args.json.with_suffix('.png'))}")
    if args.json and args.modes is not None:
        from megarl.bench.modes_plot import plot_modes

        print(f"wrote {plot_modes(result, args.json.with_suffix('.png'))}")
    return 0


def _modes_problem(args: argparse.Namespace) -> str | None:
    """Why --modes cannot run as given (None: it can, or it is not given)."""
    if args.modes is None:
        return None
    from megarl.bench.step_modes import MODES

    if args.benchmark != "step" or args.peer is not None:
        return "compares whole steps of megarl alone; use megarl bench step --modes ... without --peer"
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown or not args.modes:
        return f"unknown {', '.join(unknown) or 'empty list'}; choose among {', '.join(MODES)}"
    return None


def _peer_contenders() -> tuple[str, ...]:
    from megarl.bench.peer import CONTENDERS

    return CONTENDERS


def _run(args: argparse.Namespace, tmp: Path) -> tuple[dict, str]:
    if args.peer is not None:
        from megarl.bench import peer

        names = tuple(args.contenders.split(",")) if args.contenders else peer.CONTENDERS
        result = peer.run(
            args.config, args.repeats, tmp, args.smoke, args.workload, names, args.seed, args.sweep_megarl
        )
        return result, peer.markdown(result)
    module = importlib.import_module(f"megarl.bench.{args.benchmark}")
    if args.benchmark == "step":
        overrides = [f"model.path={args.model}"] if args.model else []
        overrides += (
            [
                "data.train_batch_size=4",
                "rollout.n=4",
                "actor.ppo_mini_batch_size=4",
                "actor.micro_batch_size_per_gpu=8",
            ]
            if args.smoke
            else []
        )
        if args.modes:
            from megarl.bench import step_modes

            modes = tuple(args.modes.split(","))
            result = step_modes.run(args.config, overrides, args.repeats, modes, args.seed, args.rounds)
            return result, step_modes.markdown(result)
        result = module.run(args.config, overrides, args.repeats)
        return result, module.markdown(result)
    model = str(args.model or _make_model(tmp, args.smoke, args.benchmark))
    if args.benchmark == "rollout":
        shape = module.RolloutShape(prompts=4, n=2, max_new_tokens=4) if args.smoke else module.RolloutShape()
        result = module.run(model, shape, args.repeats, compiled=not args.smoke)
    elif args.benchmark == "train":
        if args.smoke:
            result = module.run(
                model,
                module.TrainShape(samples=4, micro_batch=2, prompt_length=8, response_length=8),
                args.repeats,
                layouts=(),
            )
        else:
            result = module.run(model, module.TrainShape(), args.repeats)
    else:  # sync
        result = module.run(model, args.repeats, module.SMOKE) if args.smoke else module.run(model, args.repeats)
    return result, module.markdown(result)


def _make_model(tmp: Path, smoke: bool, benchmark: str) -> Path:
    from megarl.bench.sync import MODEL_100M
    from megarl.models.tiny import make_tiny_model

    shape = {} if smoke else MODEL_100M if benchmark == "sync" else BENCH_MODEL
    return make_tiny_model(tmp / "model", "qwen2", **shape)
