"""End-to-end GRPO step breakdown from the trainer's own `timing/*` metrics.

Runs the real `Trainer` (Ray, the policy and rollout worker groups, the weight-sync bridge) on a
recipe for `warmup + repeats` steps, reads `metrics.jsonl` of the run and reports, per phase, the
median over the measured steps and its share of the step; "other" is the step minus the timed
phases (driver work between phases: batch assembly, splitting, advantage bookkeeping, metrics,
Ray call overhead). The sync phase is split further with the bridge's own `sync/seconds` (the
send itself, on the trainer): the rest of it is the receive hand-shake calls and, on the steps
`rollout.sync.verify_every` selects, the log-prob check of the synced weights
(`megarl.cluster.sync_step.WeightSync`).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

STEP = "timing/step"
PER_STEP = ("reward/mean", "response_length/mean", "timing/rollout")
"""Metrics kept for every step, warm-up included (`per_step`): the reward curve and what generation did."""


def run(config_path: str, overrides: list[str], repeats: int, warmup: int = 1) -> dict:
    from megarl.bench.common import context, model_summary
    from megarl.trainer.sinks import METRICS_FILE
    from megarl.trainer.trainer import Trainer

    # Ray's raylet starts its workers at nice 15 (its `worker_niceness`): on a machine that runs anything else,
    # megarl's ranks and engines would then yield to it while a peer or a baseline, a plain process, would not.
    os.environ.setdefault("RAY_worker_niceness", "0")
    with tempfile.TemporaryDirectory(prefix="megarl-bench-step-") as out:
        run_overrides = [
            *overrides,
            f"trainer.total_steps={warmup + repeats}",
            "trainer.test_freq=0",
            "checkpoint.save_freq=0",
            f"trainer.output_dir={out}",
            "trainer.experiment_name=bench",
            "trainer.loggers=[jsonl]",
            f"checkpoint.dir={out}/checkpoints",
        ]
        trainer = Trainer.from_config(config_path, run_overrides)
        trainer.fit()
        rows = [json.loads(line) for line in (Path(out) / "bench" / METRICS_FILE).read_text().splitlines() if line]
    measured = [row for row in rows if row["step"] > warmup]
    result = dict(
        benchmark="step",
        context=context(),
        model=model_summary(trainer.config.model.path),
        config=config_path,
        overrides=run_overrides[: len(overrides)],
        warmup_steps=warmup,
        repeats=len(measured),
        samples_per_step=trainer.plan.samples_per_step,
        update_mfu=_median(measured, "perf/mfu"),
        peak_tflops=_median(measured, "perf/peak_tflops"),
        per_step={name: [row.get(name) for row in rows] for name in PER_STEP},
        **breakdown(measured),
    )
    return result


def _median(rows: list[dict], name: str) -> float | None:
    """The median of a metric over the measured steps; None when no step logged it."""
    values = [row[name] for row in rows if name in row]
    return statistics.median(values) if values else None


def breakdown(rows: list[dict]) -> dict:
    """Median seconds per phase over `rows` (metrics of measured steps), "other" = step − phases
    (per step, then the median), and each as a share of the median step."""
    phases = sorted({k for row in rows for k in row if k.startswith("timing/") and k != STEP})
    per_phase = {p.removeprefix("timing/"): [row.get(p, 0.0) for row in rows] for p in phases}
    per_phase["other"] = [row[STEP] - sum(row.get(p, 0.0) for p in phases) for row in rows]
    step = statistics.median(row[STEP] for row in rows)
    medians = {name: statistics.median(values) for name, values in per_phase.items()}
    transfer = [row["sync/seconds"] for row in rows if "sync/seconds" in row]
    return dict(
        step_seconds=step,
        step_seconds_all=[row[STEP] for row in rows],
        sync_transfer_seconds=statistics.median(transfer) if transfer else None,
        phase_seconds=medians,
        phase_share={name: seconds / step for name, seconds in medians.items()},
        other_share_per_step=[o / row[STEP] for o, row in zip(per_phase["other"], rows)],
    )


def markdown(result: dict) -> str:
    lines = [
        f"step: {result['config']} ({result['samples_per_step']} samples per step), median of {result['repeats']} steps "
        f"after {result['warmup_steps']} warm-up step(s); step {result['step_seconds']:.3f} s",
        "| phase | median s | share of step |",
        "|---|---|---|",
    ]
    for name, seconds in result["phase_seconds"].items():
        lines.append(f"| {name} | {seconds:.3f} | {result['phase_share'][name]:.1%} |")
    if result["sync_transfer_seconds"] is not None and "sync" in result["phase_seconds"]:
        lines.append(
            f"sync: the weight transfer itself (`sync/seconds`) is {result['sync_transfer_seconds']:.3f} s of "
            f"the phase's {result['phase_seconds']['sync']:.3f} s; the rest is hand-shake calls and the "
            "log-prob check"
        )
    if result["update_mfu"] is not None:
        lines.append(
            f"actor update: MFU {result['update_mfu']:.1%} of the measured matmul peak "
            f"({result['peak_tflops'] * 1e3:.1f} GFLOP/s, perf/mfu)"
        )
    other = result["phase_share"]["other"]
    lines.append(f"other: {other:.1%} of the step (goal ≤ 10 %: {'met' if other <= 0.10 else 'not met'})")
    return "\n".join(lines)
