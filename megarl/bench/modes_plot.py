"""The rollout modes' reward curves as one PNG (`megarl bench step --modes ... --json X.json` writes X.png):
each mode's reward per step (faint) with its rolling mean, and its step time. Drawn on the Agg canvas
directly, as `megarl.bench.peer_plot` draws the peer comparison."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megarl.trainer.plots import rolling_mean, rolling_window

FIGURE_INCHES = (12, 5)
_DPI = 100


def plot_modes(result: dict, out_path: Path) -> Path:
    """Draws every mode of a `megarl.bench.step_modes.run` result: reward and seconds per step."""
    figure = Figure(figsize=FIGURE_INCHES, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    first = next(iter(result["modes"].values()))
    figure.suptitle(
        f"rollout modes on {result['config']}: {first['samples_per_step']} samples per step, seed {result['seed']}"
    )
    reward_axes, time_axes = figure.subplots(1, 2)
    for mode, run in result["modes"].items():
        rewards = run["per_step"]["reward/mean"]
        steps = range(1, len(rewards) + 1)
        (line,) = reward_axes.plot(steps, rewards, alpha=0.25)
        reward_axes.plot(steps, rolling_mean(rewards, rolling_window(len(rewards))), color=line.get_color(), label=mode)
        measured = run["step_seconds_all"]
        time_axes.plot(
            range(len(steps) - len(measured) + 1, len(steps) + 1), measured, color=line.get_color(), label=mode
        )
    for axes, title in (
        (reward_axes, "reward (rolling mean; faint: each step)"),
        (time_axes, "seconds per step (after the warm-up)"),
    ):
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.savefig(out_path, format="png")
    return out_path
