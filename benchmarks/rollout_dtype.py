"""Generation in the rollout engine's own dtype (`rollout.dtype`): the same prompts and seeds through
two megarl engines of the same checkpoint, one in float32 and one in bfloat16, alternating rounds,
median of `--repeats`. Issue 19's workload: a 23.7 M-parameter Qwen2 (hidden 512, 8 layers, ffn 1408,
8 heads / 4 KV, vocab 100), 16 prompts × 8 samples, 64 new tokens each (no stop token).

    python benchmarks/rollout_dtype.py --json benchmarks/results/extra/rollout_dtype.json
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# The engine core in this process, as the trainer's workers run it (megarl.trainer.settings.WORKER_ENV).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

DTYPES = ("float32", "bfloat16")
MODEL = dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1408, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)


def main() -> None:
    from megarl.bench.common import context, model_summary, time_interleaved, write_json
    from megarl.bench.rollout import RolloutShape, make_prompts
    from megarl.config.memory import ModelShape
    from megarl.models.tiny import make_tiny_model
    from megarl.workers.rollout.base import SamplingConfig
    from megarl.workers.rollout.rollout_worker import RolloutWorker

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("outputs/rollout_dtype"))
    args = parser.parse_args()

    model_dir = args.workdir / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, "qwen2", **MODEL)
    shape = RolloutShape(prompts=16, n=8, prompt_length=24, max_new_tokens=64)
    token_ids = [list(p.token_ids) for p in make_prompts(shape, ModelShape.of(str(model_dir)).vocab_size)]
    sampling = SamplingConfig(n=shape.n, temperature=1.0, max_new_tokens=shape.max_new_tokens, seed=1234)
    workers = {dtype: RolloutWorker("vllm", str(model_dir), tensor_parallel_size=1, dtype=dtype, seed=0,
                                    max_model_len=shape.prompt_length + shape.max_new_tokens, cpu_kv_cache_gib=1,
                                    gpu_memory_utilization=0.5, enforce_eager=False)
               for dtype in DTYPES}
    try:
        timings = time_interleaved({dtype: lambda w=worker: w.generate(token_ids, sampling)
                                    for dtype, worker in workers.items()}, args.repeats)
    finally:
        for worker in workers.values():
            worker.shutdown()
    tokens = shape.prompts * shape.n * shape.max_new_tokens
    report = dict(
        benchmark="rollout_dtype", context=context(), model=model_summary(model_dir), shape=shape.__dict__,
        repeats=args.repeats, generated_tokens=tokens, seconds=timings.seconds,
        median_seconds={dtype: timings.median(dtype) for dtype in DTYPES},
        tokens_per_second={dtype: tokens / timings.median(dtype) for dtype in DTYPES},
        float32_over_bfloat16=timings.ratio("float32", "bfloat16"),
        float32_over_bfloat16_paired=timings.paired_ratio("float32", "bfloat16"),
    )
    write_json(args.json, report)
    print({key: report[key] for key in ("median_seconds", "float32_over_bfloat16", "float32_over_bfloat16_paired")})


if __name__ == "__main__":
    main()
