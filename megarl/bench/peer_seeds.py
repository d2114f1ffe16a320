"""The peer comparison's rewards over several seeds (`megarl bench step --peer trl --seed S` runs, one JSON
each): whether each system's reward rises, seed by seed, as a table and one PNG panel per contender.

On the comparison's workload a run learns only once a few lucky groups get a reward spread (at random
init ~1 % of first characters are right), so one run per system says little about learning itself;
this puts the seeds side by side.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megarl.bench.peer import reward_rise
from megarl.trainer.plots import rolling_mean, rolling_window

RISE = 0.05
"""A run has risen when the mean reward of its last quarter of steps exceeds its first quarter's by this
much (five right answers in a hundred; the random-init chance is ~0.01)."""


def runs_by_seed(results: Sequence[dict]) -> dict[str, dict[int, list[float]]]:
    """contender -> seed -> reward per step, from `megarl.bench.peer.run` results taken in order: a later
    result's run of the same contender and seed replaces an earlier one (a rerun after a fix). Results
    written before the `seed` key existed ran seed 0. Failed runs are left out."""
    runs: dict[str, dict[int, list[float]]] = {}
    for result in results:
        for name, contender in result["contenders"].items():
            if "reward_per_step" in contender:
                runs.setdefault(name, {})[result.get("seed", 0)] = contender["reward_per_step"]
    return {name: dict(sorted(seeds.items())) for name, seeds in runs.items()}


def has_risen(rewards: Sequence[float]) -> bool:
    first, last = reward_rise(list(rewards))
    return last - first >= RISE


def markdown(runs: dict[str, dict[int, list[float]]]) -> str:
    """One row per contender: each seed's reward, first → last quarter of its steps, the mean over seeds,
    and how many seeds rose by `RISE`."""
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    header = ["contender", *(f"seed {seed}" for seed in seeds), "mean over seeds", f"seeds risen (≥ {RISE:+.2f})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, by_seed in runs.items():
        rises = {seed: reward_rise(rewards) for seed, rewards in by_seed.items()}
        cells = [f"{rises[seed][0]:.2f} → {rises[seed][1]:.2f}" if seed in rises else "—" for seed in seeds]
        mean = [statistics.mean(rise[k] for rise in rises.values()) for k in (0, 1)]
        risen = sum(has_risen(rewards) for rewards in by_seed.values())
        lines.append(
            "| " + " | ".join([name, *cells, f"{mean[0]:.2f} → {mean[1]:.2f}", f"{risen} of {len(by_seed)}"]) + " |"
        )
    return "\n".join(lines)


def plot_seeds(runs: dict[str, dict[int, list[float]]], out_path: Path) -> Path:
    """One panel per contender: each seed's reward per step as a rolling mean."""
    figure = Figure(figsize=(4 * max(1, len(runs)), 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle("reward per step by seed (rolling mean), megarl and TRL on repeat_first_char")
    axes_row = figure.subplots(1, max(1, len(runs)), sharey=True, squeeze=False)[0]
    for axes, (name, by_seed) in zip(axes_row, runs.items()):
        for seed, rewards in by_seed.items():
            axes.plot(
                range(1, len(rewards) + 1), rolling_mean(rewards, rolling_window(len(rewards))), label=f"seed {seed}"
            )
        axes.set_title(name)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.savefig(out_path, format="png")
    return out_path
