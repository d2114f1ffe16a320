"""metrics.jsonl: one object per step, flushed each step, and the resume policy (no duplicate steps)."""

import json
import math

import pytest

from megarl.trainer.sinks import METRICS_FILE, JsonlSink, MetricsLogger, read_metrics_file


def _log_steps(run_dir, steps, resumed_step=None, tag=0.0):
    with MetricsLogger(run_dir, ["jsonl"], total_steps=10, resumed_step=resumed_step) as metrics_logger:
        for step in steps:
            metrics_logger.log(step, {"reward/mean": step + tag, "actor/loss": -step})


def test_round_trip_and_flushed_every_step(tmp_path):
    sink = JsonlSink(tmp_path / METRICS_FILE, resumed_step=None)
    sink.log(1, {"reward/mean": 0.5, "actor/grad_norm": math.inf, "actor/loss": math.nan})
    # Flushed: readable while the sink is still open (a crash right after loses nothing).
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "reward/mean": 0.5, "actor/grad_norm": None, "actor/loss": None}
    ]
    sink.log(2, {"reward/mean": 0.75})
    sink.close()
    assert read_metrics_file(tmp_path / METRICS_FILE) == [
        {"step": 1, "reward/mean": 0.5, "actor/grad_norm": None, "actor/loss": None},
        {"step": 2, "reward/mean": 0.75},
    ]


def test_resume_drops_the_steps_after_the_checkpoint_and_appends(tmp_path):
    _log_steps(tmp_path, range(1, 6))  # crashed after step 5, checkpoint at 3
    _log_steps(tmp_path, range(4, 8), resumed_step=3, tag=100.0)
    records = read_metrics_file(tmp_path / METRICS_FILE)
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5, 6, 7]
    assert [record["reward/mean"] for record in records] == [1, 2, 3, 104, 105, 106, 107]


def test_fresh_run_starts_an_empty_file(tmp_path):
    _log_steps(tmp_path, range(1, 4))
    _log_steps(tmp_path, range(1, 3), tag=10.0)
    assert [record["reward/mean"] for record in read_metrics_file(tmp_path / METRICS_FILE)] == [11, 12]


def test_a_line_cut_by_a_crash_is_skipped_other_damage_is_reported(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "reward/mean": 1.0}\n{"step": 2, "rew')
    assert read_metrics_file(path) == [{"step": 1, "reward/mean": 1.0}]
    path.write_text('{"step": 1, "reward/mean": 1.0}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{METRICS_FILE}:2"):
        read_metrics_file(path)


def test_steps_are_logged_once_in_order_and_values_must_be_numbers(tmp_path):
    with MetricsLogger(tmp_path, ["jsonl"], total_steps=10, resumed_step=4) as metrics_logger:
        with pytest.raises(ValueError, match="step 4 logged after step 4"):
            metrics_logger.log(4, {"reward/mean": 1.0})
        metrics_logger.log(5, {"reward/mean": 1.0})
        with pytest.raises(ValueError, match="step 5 logged after step 5"):
            metrics_logger.log(5, {"reward/mean": 1.0})
        with pytest.raises(TypeError, match="'actor/lr' of step 6 is 'high'"):
            metrics_logger.log(6, {"actor/lr": "high"})
    assert [record["step"] for record in read_metrics_file(tmp_path / METRICS_FILE)] == [5]
