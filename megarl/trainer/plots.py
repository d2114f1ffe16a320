"""Training curves of a run as one PNG: reward (with a rolling mean), response length, KL to the
reference and the weight-sync log-prob gap, over steps; and the memory of each role through the
phases of the last step's hand-over (`megarl.cluster.handover`) as a second one.

Written at the end of every run and by `megarl plot RUN_DIR`, as `RUN_DIR/curves.png` and
`RUN_DIR/memory.png` (`FIGURE_PIXELS` wide × high). Drawn on the Agg canvas directly, so no display
and no pyplot state.
"""

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megarl.cluster.memory_metrics import MEMORY_PHASES, MEMORY_ROLES, MEMORY_STATS, memory_metric

CURVES_FILE = "curves.png"
"""The curves' file name in the run directory."""
MEMORY_FILE = "memory.png"
"""The memory plot's file name in the run directory."""
FIGURE_PIXELS = (1200, 800)
"""Width and height of the PNG."""
_DPI = 100

# (panel title, metrics drawn in it, y on a log scale when every value is > 0)
_PANELS = (
    ("reward", ("reward/mean", "val/reward/mean", "agent/tool_call_rate"), False),  # the rate: multi-turn only
    ("response length (tokens)", ("response_length/mean", "response_length/max"), False),
    ("KL(policy ‖ reference)", ("actor/kl", "actor/reward_kl_penalty"), False),
    ("sync log-prob gap |rollout - actor|", ("sync/logprob_max_abs_diff", "sync/logprob_mean_abs_diff"), True),
)


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start), skipping NaNs; NaN where a
    window holds none. `[N] -> [N]`."""
    means = []
    for end in range(1, len(values) + 1):
        finite = [v for v in values[max(0, end - window) : end] if not math.isnan(v)]
        means.append(sum(finite) / len(finite) if finite else math.nan)
    return means


def rolling_window(num_steps: int) -> int:
    """Steps averaged by the reward's rolling mean: a tenth of the run, at least 5."""
    return max(5, num_steps // 10)


def plot_metrics(records: Sequence[dict[str, float | None]], out_path: Path, title: str = "") -> Path:
    """Draws the panels from `metrics.jsonl` records (a metric a step lacks, or null, is a gap) to `out_path`."""
    figure = Figure(figsize=(FIGURE_PIXELS[0] / _DPI, FIGURE_PIXELS[1] / _DPI), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(f"{title}  (step {records[-1]['step']})" if title else f"step {records[-1]['step']}")
    for axes, (panel_title, names, log_scale) in zip(figure.subplots(2, 2).flat, _PANELS):
        axes.set_title(panel_title)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        series = {name: _series(records, name) for name in names}
        series = {name: (steps, values) for name, (steps, values) in series.items() if steps}
        if not series:
            axes.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axes.transAxes, color="gray")
            continue
        for name, (steps, values) in series.items():
            axes.plot(steps, values, label=name, alpha=0.45 if name == "reward/mean" else 1.0)
            if name == "reward/mean":
                window = rolling_window(len(steps))
                axes.plot(steps, rolling_mean(values, window), label=f"reward/mean, rolling mean of {window}")
        finite = [v for _, values in series.values() for v in values if not math.isnan(v)]
        if log_scale and finite and min(finite) > 0:
            axes.set_yscale("log")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.savefig(out_path, format="png")
    return out_path


def plot_memory(records: Sequence[dict[str, float | None]], out_path: Path, title: str = "") -> Path | None:
    """One panel per memory stat the run logged (`memory/<role>/<phase>/<stat>`): each role's GiB
    through the hand-over's phases (`MEMORY_PHASES` order) of the last step that has them, drawn to
    `out_path`. Between the phases where a role was measured it holds what it held (only the acting
    group reports, besides the snapshots after generating and training). None when no step has any."""
    measured = [record for record in records if any(name.startswith("memory/") for name in record)]
    if not measured:
        return None
    record = measured[-1]
    stats = [stat for stat in MEMORY_STATS if any(name.endswith(f"/{stat}") for name in record)]
    phases = [phase for phase in MEMORY_PHASES if any(f"/{phase}/" in name for name in record)]
    figure = Figure(figsize=(FIGURE_PIXELS[0] / _DPI, FIGURE_PIXELS[1] / _DPI), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(f"{title}  memory per hand-over phase (step {record['step']})".strip())
    for axes, stat in zip(figure.subplots(len(stats), 1, squeeze=False).flat, stats):
        axes.set_title(stat)
        axes.set_ylabel("GiB")
        for role in MEMORY_ROLES:
            values = [record.get(memory_metric(role, phase, stat)) for phase in phases]
            if any(value is not None for value in values):
                (line,) = axes.plot(phases, _carried(values), drawstyle="steps-post", label=role)
                measured_at = [(phase, value) for phase, value in zip(phases, values) if value is not None]
                axes.plot(*zip(*measured_at), "o", color=line.get_color())  # a dot where the role reported
        axes.tick_params(axis="x", labelrotation=20)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.savefig(out_path, format="png")
    return out_path


def _carried(values: list[float | None]) -> list[float]:
    """Each missing value replaced by the one before it (NaN before the first)."""
    carried, last = [], math.nan
    for value in values:
        last = last if value is None else value
        carried.append(last)
    return carried


def _series(records: Sequence[dict[str, float | None]], name: str) -> tuple[list[int], list[float]]:
    """Steps that have `name` and its values (null -> NaN)."""
    steps = [record["step"] for record in records if name in record]
    values = [math.nan if record[name] is None else record[name] for record in records if name in record]
    return steps, values
