"""Generation by engine setting: the same prompts and seeds through four megarl engines of the same
checkpoint, float32 or bfloat16 (`rollout.dtype`), eager or compiled (`rollout.enforce_eager`),
rounds alternating, median of `--repeats`, in wall time and in this process's CPU time (the engines
run in it; CPU time moves less when other jobs share the cores). Each engine's start is timed too:
compiling is paid there.
Issue 19's workload: a 23.7 M-parameter Qwen2 (hidden 512, 8 layers, ffn 1408, 8 heads / 4 KV,
vocab 100), 16 prompts × 8 samples, 64 new tokens each (no stop token).

    python benchmarks/rollout_engine.py --json benchmarks/results/extra/rollout_engine.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

# The engine core in this process, as the trainer's workers run it (megarl.trainer.settings.WORKER_ENV).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ENGINES = {  # name: (rollout.dtype, rollout.enforce_eager)
    "float32 eager": ("float32", True),
    "float32 compiled": ("float32", False),
    "bfloat16 eager": ("bfloat16", True),
    "bfloat16 compiled": ("bfloat16", False),
}
MODEL = dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1408, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)


def main() -> None:
    from megarl.bench.common import Timings, context, model_summary, time_interleaved, write_json
    from megarl.bench.rollout import RolloutShape, make_prompts
    from megarl.config.memory import ModelShape
    from megarl.models.tiny import make_tiny_model
    from megarl.workers.rollout.base import SamplingConfig
    from megarl.workers.rollout.rollout_worker import RolloutWorker

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("outputs/rollout_engine"))
    args = parser.parse_args()

    model_dir = args.workdir / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, "qwen2", **MODEL)
    shape = RolloutShape(prompts=16, n=8, prompt_length=24, max_new_tokens=64)
    token_ids = [list(p.token_ids) for p in make_prompts(shape, ModelShape.of(str(model_dir)).vocab_size)]
    sampling = SamplingConfig(n=shape.n, temperature=1.0, max_new_tokens=shape.max_new_tokens, seed=1234)
    workers, start_seconds = {}, {}
    try:
        for name, (dtype, eager) in ENGINES.items():
            began = time.perf_counter()
            workers[name] = RolloutWorker(
                "vllm", str(model_dir), tensor_parallel_size=1, dtype=dtype, seed=0,
                max_model_len=shape.prompt_length + shape.max_new_tokens, cpu_kv_cache_gib=1,
                gpu_memory_utilization=0.5, enforce_eager=eager)
            start_seconds[name] = time.perf_counter() - began
        cpu_seconds = {name: [] for name in ENGINES}

        def generate(name: str) -> None:
            began = time.process_time()
            workers[name].generate(token_ids, sampling)
            cpu_seconds[name].append(time.process_time() - began)

        timings = time_interleaved({name: lambda n=name: generate(n) for name in ENGINES}, args.repeats)
        cpu = Timings({name: seconds[-args.repeats:] for name, seconds in cpu_seconds.items()})  # warm-up left out
    finally:
        for worker in workers.values():
            worker.shutdown()
    tokens = shape.prompts * shape.n * shape.max_new_tokens
    baseline = "float32 eager"
    report = dict(
        benchmark="rollout_engine", context=context(), model=model_summary(model_dir), shape=shape.__dict__,
        engines={name: dict(dtype=dtype, enforce_eager=eager) for name, (dtype, eager) in ENGINES.items()},
        repeats=args.repeats, generated_tokens=tokens, seconds=timings.seconds, start_seconds=start_seconds,
        median_seconds={name: timings.median(name) for name in ENGINES},
        tokens_per_second={name: tokens / timings.median(name) for name in ENGINES},
        speedup_over_float32_eager={name: timings.ratio(baseline, name) for name in ENGINES},
        speedup_over_float32_eager_paired={name: timings.paired_ratio(baseline, name) for name in ENGINES},
        cpu_seconds=cpu.seconds, median_cpu_seconds={name: cpu.median(name) for name in ENGINES},
        cpu_speedup_over_float32_eager={name: cpu.ratio(baseline, name) for name in ENGINES},
    )
    write_json(args.json, report)
    print({key: report[key] for key in ("start_seconds", "median_seconds", "speedup_over_float32_eager",
                                        "speedup_over_float32_eager_paired", "cpu_speedup_over_float32_eager")})


if __name__ == "__main__":
    main()
