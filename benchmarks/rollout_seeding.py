"""What megarl's reproducible sampling costs: the same prompts through one engine, each call once with a
seed per sample (megarl's default: `rollout.seed`, sample j of prompt i seeded seed + i·n + j, so the same
seed gives the same samples on any number of engines), once with one seed for the call
(`rollout.seed_each_sample: false`: the engine's one generator reseeded before the call, the same samples
on the same engines) and once unseeded (the engine's one generator, as TRL and verl call vLLM), calls
alternating, median and paired ratios of `--repeats` after a warm-up.

vLLM draws the sampling noise of seeded requests row by row, one generator each, and of unseeded ones
in a single call (vllm/v1/sample/ops/topk_topp_sampler.py, `random_sample`): the difference is that loop.
Issue 19's workload (23.7 M-parameter Qwen2, 16 prompts × 8 samples × 64 new tokens, log-probs asked),
an fp32 engine compiled or eager (`rollout.enforce_eager`), in this process.

    python benchmarks/rollout_seeding.py --json benchmarks/results/extra/rollout_seeding.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--eager", action="store_true", help="an eager engine (default: compiled, as TRL's vLLM runs)")
    parser.add_argument("--workdir", type=Path, default=Path("outputs/rollout_engine"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, as in a run

    from benchmarks.rollout_engine import MODEL
    from megarl.bench.common import context, model_summary, time_interleaved, write_json
    from megarl.bench.rollout import RolloutShape, make_prompts
    from megarl.models.hf_config import read_model_dims
    from megarl.models.tiny import make_tiny_model
    from megarl.workers.rollout.base import SamplingConfig
    from megarl.workers.rollout.engine_args import EngineArgs
    from megarl.workers.rollout.rollout_worker import RolloutWorker

    model_dir = args.workdir / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, "qwen2", **MODEL)
    shape = RolloutShape(prompts=16, n=8, prompt_length=24, max_new_tokens=64)
    token_ids = [list(p.token_ids) for p in make_prompts(shape, read_model_dims(str(model_dir)).vocab_size)]
    worker = RolloutWorker(
        "vllm",
        EngineArgs(
            str(model_dir),
            dtype="float32",
            max_model_len=shape.prompt_length + shape.max_new_tokens,
            enforce_eager=args.eager,
        ),
    )
    calls = {
        name: SamplingConfig(
            n=shape.n, temperature=1.0, max_new_tokens=shape.max_new_tokens, seed=seed, seed_each_sample=each
        )
        for name, seed, each in (("seeded", 1234, True), ("call_seeded", 1234, False), ("unseeded", None, True))
    }
    try:
        timings = time_interleaved(
            {name: lambda s=s: worker.generate(token_ids, s) for name, s in calls.items()}, args.repeats
        )
    finally:
        worker.shutdown()
    report = dict(
        benchmark="rollout_seeding",
        context=context(),
        model=model_summary(model_dir),
        enforce_eager=args.eager,
        repeats=args.repeats,
        generated_tokens=shape.prompts * shape.n * shape.max_new_tokens,
        wall_seconds=timings.seconds,
        median_seconds={name: timings.median(name) for name in calls},
        **{
            f"{name}_over_unseeded{kind}": ratio(name, "unseeded")
            for name in ("seeded", "call_seeded")
            for kind, ratio in (("", timings.ratio), ("_paired", timings.paired_ratio))
        },
    )
    write_json(args.json, report)
    print(
        json.dumps(
            {key: value for key, value in report.items() if key == "median_seconds" or "_over_" in key}, indent=1
        )
    )


if __name__ == "__main__":
    main()
