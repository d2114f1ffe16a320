"""`megarl bench step --modes`: one recipe's GRPO workload in several placements and rollout modes
(`placement.mode`, `trainer.rollout_mode`), run in turn with the same seeds, as samples per second side
by side (issue 31 item 5); with `rounds` > 1 every mode runs once per round, in an order rotated each round, and
the ratios are paired by round (this machine's speed drifts by ~25 % within an hour: modes run one after the
other for minutes each were compared at different speeds).

The recipe's training devices stay the Megatron roles' in every mode: colocated, the engines share
them (one engine per rollout TP group of them); split, one engine gets `rollout.tensor_model_parallel_size`
devices of its own beside them. Each mode is `megarl.bench.step.run` (a warm-up step, then --repeats
steps, medians); one_step_off's and async's first step generates alone, so the warm-up step is that one
(async runs with the recipe's trainer.max_staleness; split_async_partial adds partial rollouts of
`PARTIAL_SEGMENT` tokens, split_async_carry carries groups between steps on top, the others run without). `seed` is every mode's trainer, data and rollout
seed; each mode's reward per step is kept, its first and last 10 steps' means compared (`reward_rise`),
and `megarl bench step --modes ... --json X.json` draws the curves into X.png (`modes_plot`).
"""

from __future__ import annotations

import statistics

from megarl.config.config import Config

PARTIAL_SEGMENT = 32
"""The partial modes' `rollout.partial_rollout`: new tokens per segment, between which a weight load may land."""
MODES: dict[str, tuple[str, str, int, bool]] = {
    "colocated_sync": ("colocated", "sync", 0, False),
    "split_sync": ("split", "sync", 0, False),
    "split_one_step_off": ("split", "one_step_off", 0, False),
    "split_async": ("split", "async", 0, False),
    "split_async_partial": ("split", "async", PARTIAL_SEGMENT, False),
    "split_async_carry": ("split", "async", PARTIAL_SEGMENT, True),
}
"""Mode name -> (placement.mode, trainer.rollout_mode, rollout.partial_rollout, whether groups are carried over:
`rollout.over_sampling` half the recipe's data.train_batch_size, with trainer.max_staleness at least 2, which
carrying needs)."""
REWARD_WINDOW = 10
"""Steps whose mean reward opens and closes a mode's curve (`reward_rise`)."""
BASELINE = "split_sync"
"""The ratios' denominator when it runs (else the first mode run)."""


def mode_overrides(config: Config, mode: str) -> list[str]:
    """The overrides that run the recipe `config` in `mode` (one node)."""
    placement, rollout_mode, segment, carried = MODES[mode]
    training = config.placement.gpus_per_node - config.placement.rollout_gpus  # the Megatron roles' devices
    engine = config.rollout.tensor_model_parallel_size if placement == "split" else 0
    return [
        f"placement.mode={placement}",
        f"placement.gpus_per_node={training + engine}",
        f"placement.rollout_gpus={engine}",
        f"trainer.rollout_mode={rollout_mode}",
        f"rollout.partial_rollout={segment}",
        f"rollout.over_sampling={config.data.train_batch_size // 2 if carried else 0}",
        *([f"trainer.max_staleness={max(2, config.trainer.max_staleness)}"] if carried else []),
    ]


def run(
    config_path: str, overrides: list[str], repeats: int, modes: tuple[str, ...], seed: int = 0, rounds: int = 1
) -> dict:
    """Every mode once per round, the order rotated one more each round (`interleaved_order`), so that the
    machine's drift over the minutes of a round hits every mode alike. A mode's step time is the median of its
    rounds' medians, its ratio the median over rounds of its speed ÷ the baseline's in the same round (paired);
    its reward curve (`modes`, `reward_rise`) is that of its first round."""
    from megarl.bench import step
    from megarl.bench.common import interleaved_order
    from megarl.bench.peer import reward_rise, seed_overrides
    from megarl.config.loader import load_config

    config = load_config(config_path, overrides)
    seeded = [*overrides, *seed_overrides(seed)]
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for mode in interleaved_order(list(modes), rounds, warmup=0):
        runs[mode].append(step.run(config_path, [*seeded, *mode_overrides(config, mode)], repeats))
    by_round = {mode: [result["step_seconds"] for result in results] for mode, results in runs.items()}
    samples = runs[modes[0]][0]["samples_per_step"]
    baseline = BASELINE if BASELINE in runs else modes[0]
    return dict(
        benchmark="step_modes",
        config=config_path,
        overrides=overrides,
        baseline=baseline,
        seed=seed,
        rounds=rounds,
        samples_per_s={mode: samples / statistics.median(seconds) for mode, seconds in by_round.items()},
        step_seconds_by_round=by_round,
        reward_rise={
            mode: reward_rise(results[0]["per_step"]["reward/mean"], REWARD_WINDOW) for mode, results in runs.items()
        },
        ratios={
            mode: statistics.median(base / own for base, own in zip(by_round[baseline], seconds, strict=True))
            for mode, seconds in by_round.items()
        },
        modes={mode: results[0] for mode, results in runs.items()},
    )


def markdown(result: dict) -> str:
    first = next(iter(result["modes"].values()))
    lines = [
        f"step modes: {result['config']} ({first['samples_per_step']} samples per step), median of {first['repeats']} "
        f"steps after {first['warmup_steps']} warm-up step(s) per mode and round, {result['rounds']} round(s) "
        f"(ratios paired by round), seed {result['seed']}",
        f"| mode | step s | samples/s | × {result['baseline']} | reward first {REWARD_WINDOW} → last {REWARD_WINDOW} |",
        "|---|---|---|---|---|",
    ]
    for mode, seconds in result["step_seconds_by_round"].items():
        start, end = result["reward_rise"][mode]
        lines.append(
            f"| {mode} | {statistics.median(seconds):.3f} | {result['samples_per_s'][mode]:.2f} | "
            f"{result['ratios'][mode]:.2f} | {start:.3f} → {end:.3f} |"
        )
    return "\n".join(lines)
