"""The quickstart's GRPO run in float32 and in bfloat16, one after the other on this machine: reward
curves, the sync check of every step, and time. `model.dtype=bfloat16` trains bf16 parameters with fp32
main parameters, gradients and Adam states, and runs the engines in bf16.

    python benchmarks/quickstart_dtypes.py --json benchmarks/results/extra/quickstart_dtypes.json \\
        --png benchmarks/results/extra/quickstart_dtypes.png

Needs the quickstart's model and data (`bash scripts/quickstart.sh` makes them, or `megarl
init-tiny-model --out outputs/tiny-model` and `megarl make-data --task repeat_first_char --out
outputs/quickstart-data`). Prints a markdown table; writes the per-step rewards and sync metrics as JSON
and both reward curves as one PNG.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from megarl import Trainer

DTYPES = ("float32", "bfloat16")
WINDOW = 10
"""Steps averaged at the start and at the end of a run."""


def run(dtype: str, output_dir: Path) -> dict:
    overrides = [
        f"model.dtype={dtype}",
        "checkpoint.resume=disable",
        "checkpoint.save_freq=0",
        f"trainer.output_dir={output_dir}",
        f"trainer.experiment_name=quickstart-{dtype}",
        f"checkpoint.dir={output_dir / dtype / 'checkpoints'}",
    ]
    trainer = Trainer.from_config("configs/quickstart.yaml", overrides)
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    steps = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [step["reward/mean"] for step in steps]
    return {
        "dtype": dtype,
        "seconds": seconds,
        "rewards": rewards,
        "first_mean": sum(rewards[:WINDOW]) / WINDOW,
        "last_mean": sum(rewards[-WINDOW:]) / WINDOW,
        "sync_checks": sum("sync/checksum_tensors" in step for step in steps),
        "sync_gap_max": max(step["sync/logprob_max_abs_diff"] for step in steps if "sync/logprob_max_abs_diff" in step),
        "sync_threshold": trainer.cluster.sync.threshold,
        "val_reward_last": [step["val/reward/mean"] for step in steps if "val/reward/mean" in step][-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/quickstart-dtypes"))
    args = parser.parse_args()
    results = [run(dtype, args.output_dir) for dtype in DTYPES]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"machine": platform.processor() or platform.machine(), "runs": results}, indent=2) + "\n"
    )
    figure, axes = plt.subplots(figsize=(7, 4))
    for result in results:
        axes.plot(range(1, len(result["rewards"]) + 1), result["rewards"], label=result["dtype"])
    axes.set(xlabel="step", ylabel="reward/mean", title="quickstart GRPO: float32 vs bfloat16")
    axes.legend()
    figure.savefig(args.png, dpi=100, bbox_inches="tight")
    print(
        "| model.dtype | reward, first 10 steps | reward, last 10 steps | last val reward | synced steps checked "
        "bit for bit | max sync log-prob gap (threshold) | time |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['dtype']} | {r['first_mean']:.3f} | {r['last_mean']:.3f} | {r['val_reward_last']:.3f} | "
            f"{r['sync_checks']}/{len(r['rewards'])} | {r['sync_gap_max']:.3g} ({r['sync_threshold']:.3g}) | "
            f"{r['seconds']:.0f} s |"
        )


if __name__ == "__main__":
    main()
