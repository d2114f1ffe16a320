"""The peer comparison's curves as one PNG (`megarl bench step --peer trl --json X.json` writes X.png):
each contender's reward per step (faint) with its rolling mean, and its mean response length per step.
Drawn on the Agg canvas directly, as `megarl.trainer.plots` draws a run's curves."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megarl.trainer.plots import rolling_mean, rolling_window

FIGURE_INCHES = (12, 5)
_DPI = 100


def plot_rewards(result: dict, out_path: Path) -> Path:
    """Draws the `per_step` curves of every contender of a `megarl.bench.peer.run` result that ran."""
    figure = Figure(figsize=FIGURE_INCHES, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    shape, lengths = result["workload"], result["lengths"]
    figure.suptitle(
        f"megarl and TRL, GRPO on repeat_first_char: {result['model']['parameters'] / 1e6:.1f} M Qwen2, "
        f"{shape['prompts_per_step']} prompts × {shape['samples_per_prompt']} samples, "
        f"{lengths['min_new_tokens']} to {shape['max_new_tokens']} new tokens"
    )
    reward_axes, length_axes = figure.subplots(1, 2)
    ran = {name: contender for name, contender in result["contenders"].items() if "reward_per_step" in contender}
    for name, contender in ran.items():
        rewards = contender["reward_per_step"]
        steps = range(1, len(rewards) + 1)
        (line,) = reward_axes.plot(steps, rewards, alpha=0.25)
        reward_axes.plot(steps, rolling_mean(rewards, rolling_window(len(rewards))), color=line.get_color(), label=name)
        length_axes.plot(steps, contender["response_length_per_step"], color=line.get_color(), label=name)
    for axes, title in (
        (reward_axes, "reward (rolling mean; faint: each step)"),
        (length_axes, "mean response length (tokens)"),
    ):
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        if ran:
            axes.legend(fontsize="small")
    figure.savefig(out_path, format="png")
    return out_path
