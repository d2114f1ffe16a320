"""What a rollout engine's start costs when its process already served another run: the CPU-seconds of importing
megarl's vLLM engine, of building a first engine, and of building, using and shutting down further engines of the
same checkpoint in the same process, which must give the same samples for the same seed.

A whole-job test spends most of its CPU on its processes' start-up (issue 30: ~25 of a job's ~45 CPU-seconds);
these figures say what a pool of warm worker processes, reused from one run to the next, would save per engine.
One TP-1 engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as in a run), the quickstart's tiny model.

    python benchmarks/engine_rebuild.py --json benchmarks/results/extra/engine_rebuild.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--builds", type=int, default=4)
    parser.add_argument("--model", default="outputs/tiny-model", help="an HF checkpoint (the quickstart's tiny model)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    began = time.process_time()
    from megarl.workers.rollout.base import SamplingConfig
    from megarl.workers.rollout.engine_args import EngineArgs
    from megarl.workers.rollout.vllm_engine import VLLMRolloutEngine

    import_cpu = time.process_time() - began
    from megarl.bench.common import context, model_summary, write_json

    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=16, seed=1234)
    builds, uses, samples = [], [], []
    for _ in range(args.builds):
        began = time.process_time()
        engine = VLLMRolloutEngine(EngineArgs(args.model, dtype="float32", max_model_len=64))
        built = time.process_time()
        samples.append(engine.generate([[3, 4, 5, 6]], sampling)[0].response_token_ids)
        engine.shutdown()
        builds.append(built - began)
        uses.append(time.process_time() - began)
    report = dict(
        benchmark="engine_rebuild",
        context=context(),
        model=model_summary(args.model),
        import_cpu_seconds=import_cpu,
        build_cpu_seconds=builds,
        build_use_shutdown_cpu_seconds=uses,
        same_samples_every_build=all(s == samples[0] for s in samples),
    )
    write_json(args.json, report)
    print(json.dumps({key: value for key, value in report.items() if key not in ("context", "model")}, indent=1))


if __name__ == "__main__":
    main()
