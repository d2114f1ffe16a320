"""Generation by engine setting: the same prompts and seeds through four megarl engines of the same
checkpoint, float32 or bfloat16 (`rollout.dtype`), eager or compiled (`rollout.enforce_eager`). Each
engine lives in a process of its own, as in a run (one rollout worker per engine), and waits while
another generates: rounds alternate with the order rotating, median of `--repeats`, in wall time and
in the engine process's CPU time. Each engine's start is timed too: compiling is paid there.
Issue 19's workload: a 23.7 M-parameter Qwen2 (hidden 512, 8 layers, ffn 1408, 8 heads / 4 KV,
vocab 100), 16 prompts × 8 samples, 64 new tokens each (no stop token).

    python benchmarks/rollout_engine.py --json benchmarks/results/extra/rollout_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ENGINES = {  # name: (rollout.dtype, rollout.enforce_eager)
    "float32 eager": ("float32", True),
    "float32 compiled": ("float32", False),
    "bfloat16 eager": ("bfloat16", True),
    "bfloat16 compiled": ("bfloat16", False),
}
BASELINE = "float32 eager"
MODEL = dict(
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1408,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)


def serve(model_dir: str, dtype: str, eager: bool) -> None:
    """The engine process: builds its engine, says how long that took, then generates the workload once
    per line on stdin and answers each with its wall and CPU seconds (one JSON line each)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, as in a run
    from megarl.bench.rollout import RolloutShape, make_prompts
    from megarl.models.hf_config import read_model_dims
    from megarl.workers.rollout.base import SamplingConfig
    from megarl.workers.rollout.engine_args import EngineArgs
    from megarl.workers.rollout.rollout_worker import RolloutWorker

    shape = RolloutShape(prompts=16, n=8, prompt_length=24, max_new_tokens=64)
    token_ids = [list(p.token_ids) for p in make_prompts(shape, read_model_dims(model_dir).vocab_size)]
    sampling = SamplingConfig(n=shape.n, temperature=1.0, max_new_tokens=shape.max_new_tokens, seed=1234)
    began = time.perf_counter()
    worker = RolloutWorker(
        "vllm",
        EngineArgs(
            model_dir,
            dtype=dtype,
            max_model_len=shape.prompt_length + shape.max_new_tokens,
            enforce_eager=eager,
        ),
    )
    print(
        json.dumps(
            {"start_seconds": time.perf_counter() - began, "tokens": shape.prompts * shape.n * shape.max_new_tokens}
        ),
        flush=True,
    )
    for _ in sys.stdin:
        wall, cpu = time.perf_counter(), time.process_time()
        worker.generate(token_ids, sampling)
        print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}), flush=True)
    worker.shutdown()


def _answer(process: subprocess.Popen) -> dict:
    """The engine process's next JSON line (its log lines skipped)."""
    for line in process.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"rollout_engine: an engine process ended (exit {process.wait()})")


def main() -> None:
    from megarl.bench.common import Timings, context, interleaved_order, model_summary, write_json
    from megarl.models.tiny import make_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("outputs/rollout_engine"))
    args = parser.parse_args()

    model_dir = args.workdir / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, "qwen2", **MODEL)
    processes, started = {}, {}
    try:
        for name, (dtype, eager) in ENGINES.items():  # one start at a time: each start timed alone
            processes[name] = subprocess.Popen(
                [sys.executable, __file__, "--serve", str(model_dir), dtype, str(eager)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            started[name] = _answer(processes[name])
        wall, cpu = ({name: [] for name in ENGINES} for _ in range(2))
        order = interleaved_order(list(ENGINES), args.repeats)
        for index, name in enumerate(order):
            processes[name].stdin.write("go\n")
            processes[name].stdin.flush()
            answer = _answer(processes[name])
            if index >= len(ENGINES):  # the first round warms up
                wall[name].append(answer["wall"])
                cpu[name].append(answer["cpu"])
    finally:
        for process in processes.values():
            process.stdin.close()
            process.wait()
    walls, cpus = Timings(wall), Timings(cpu)
    tokens = started[BASELINE]["tokens"]
    report = dict(
        benchmark="rollout_engine",
        context=context(),
        model=model_summary(model_dir),
        engines={name: dict(dtype=dtype, enforce_eager=eager) for name, (dtype, eager) in ENGINES.items()},
        repeats=args.repeats,
        generated_tokens=tokens,
        wall_seconds=wall,
        cpu_seconds=cpu,
        start_seconds={name: answer["start_seconds"] for name, answer in started.items()},
        median_seconds={name: walls.median(name) for name in ENGINES},
        tokens_per_second={name: tokens / walls.median(name) for name in ENGINES},
        speedup_over_float32_eager={name: walls.ratio(BASELINE, name) for name in ENGINES},
        speedup_over_float32_eager_paired={name: walls.paired_ratio(BASELINE, name) for name in ENGINES},
        cpu_speedup_over_float32_eager={name: cpus.ratio(BASELINE, name) for name in ENGINES},
    )
    write_json(args.json, report)
    print(
        json.dumps(
            {
                key: report[key]
                for key in (
                    "start_seconds",
                    "median_seconds",
                    "speedup_over_float32_eager",
                    "speedup_over_float32_eager_paired",
                    "cpu_speedup_over_float32_eager",
                )
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], sys.argv[3], sys.argv[4] == "True")
    else:
        main()
