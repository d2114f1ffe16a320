"""curves.png and memory.png: written at close and by `megarl plot`, real PNGs of the documented size."""

import math
import struct

from megarl.cli.main import main
from megarl.trainer.plots import CURVES_FILE, FIGURE_PIXELS, MEMORY_FILE, rolling_mean
from megarl.trainer.sinks import MetricsLogger


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def _run(run_dir, steps=12):
    with MetricsLogger(run_dir, ["jsonl"], total_steps=steps) as metrics_logger:
        for step in range(1, steps + 1):
            metrics_logger.log(
                step,
                {
                    "reward/mean": step / steps,
                    "response_length/mean": 10 + step,
                    "actor/kl": 0.01 * step,
                    "sync/logprob_max_abs_diff": 1e-7,
                },
            )
    return metrics_logger


def test_closing_the_logger_writes_the_plot(tmp_path):
    _run(tmp_path)
    assert _png_size(tmp_path / CURVES_FILE) == FIGURE_PIXELS


def test_no_plot_when_no_step_was_logged(tmp_path):
    assert MetricsLogger(tmp_path, ["jsonl"], total_steps=3).close() is None
    assert not (tmp_path / CURVES_FILE).exists()


def test_plot_command_redraws_a_run(tmp_path, capsys):
    _run(tmp_path)
    (tmp_path / CURVES_FILE).unlink()
    assert main(["plot", str(tmp_path)]) == 0
    assert _png_size(tmp_path / CURVES_FILE) == FIGURE_PIXELS
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "other.png")]) == 0
    assert _png_size(tmp_path / "other.png") == FIGURE_PIXELS
    assert f"wrote {tmp_path / 'other.png'} (12 steps)" in capsys.readouterr().out


def test_plot_command_without_metrics_exits_2_naming_the_path(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert f"no metrics file at {tmp_path / 'metrics.jsonl'}" in error
    assert "Traceback" not in error


def test_rolling_mean_trails_and_skips_nan():
    assert rolling_mean([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    means = rolling_mean([math.nan, 2.0, math.nan, 4.0], window=2)
    assert math.isnan(means[0]) and means[1:] == [2.0, 2.0, 4.0]


def _memory_run(run_dir, steps=2):
    """A run that logged the hand-over's memory, as a colocated CPU run does (`megarl.cluster.handover`)."""
    phases = {
        "rollout": ("generated", "asleep", "trained", "weights_awake", "awake"),
        "actor": ("generated", "onloaded", "trained", "training_offloaded", "params_offloaded"),
    }
    with MetricsLogger(run_dir, ["jsonl"], total_steps=steps) as metrics_logger:
        for step in range(1, steps + 1):
            memory = {
                f"memory/{role}/{phase}/rss_gib": 1.0 + index / 10
                for role, names in phases.items()
                for index, phase in enumerate(names)
            }
            metrics_logger.log(step, {"reward/mean": 0.5, **memory})


def test_a_run_with_memory_metrics_gets_memory_png(tmp_path, capsys):
    _memory_run(tmp_path)
    assert _png_size(tmp_path / MEMORY_FILE) == FIGURE_PIXELS
    (tmp_path / MEMORY_FILE).unlink()
    assert main(["plot", str(tmp_path)]) == 0
    assert _png_size(tmp_path / MEMORY_FILE) == FIGURE_PIXELS


def test_no_memory_png_without_memory_metrics(tmp_path):
    _run(tmp_path)
    assert not (tmp_path / MEMORY_FILE).exists()
