"""TensorBoard event files, read back with TensorBoard's own reader, resume included; W&B without the package."""

import sys
import textwrap

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.trainer.sinks import METRICS_FILE, TENSORBOARD_DIR, LoggerSetupError, MetricsLogger


def _scalars(log_dir, tag):
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_scalars_reach_the_event_file(tmp_path):
    with MetricsLogger(tmp_path, ["tensorboard"], total_steps=3) as metrics_logger:
        for step in (1, 2, 3):
            metrics_logger.log(step, {"reward/mean": step / 4, "timing/step": 1.5})
    assert list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert _scalars(tmp_path / TENSORBOARD_DIR, "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert _scalars(tmp_path / TENSORBOARD_DIR, "timing/step") == [(1, 1.5), (2, 1.5), (3, 1.5)]


def test_resumed_run_replaces_the_rerun_steps(tmp_path):
    with MetricsLogger(tmp_path, ["tensorboard"], total_steps=5) as metrics_logger:
        for step in (1, 2, 3, 4):
            metrics_logger.log(step, {"reward/mean": 0.0})
    with MetricsLogger(tmp_path, ["tensorboard"], total_steps=5, resumed_step=2) as metrics_logger:
        for step in (3, 4, 5):
            metrics_logger.log(step, {"reward/mean": 1.0})
    assert _scalars(tmp_path / TENSORBOARD_DIR, "reward/mean") == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0)]


def test_the_run_description_is_one_text_summary_at_the_runs_first_step(tmp_path):
    description = {"actor": {"optim": {"lr": 1e-06}}, "batch_plan": {"samples_per_step": 128}}
    with MetricsLogger(tmp_path, ["tensorboard"], total_steps=2, description=description) as metrics_logger:
        metrics_logger.log(1, {"reward/mean": 0.5})
    accumulator = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    accumulator.Reload()
    [event] = accumulator.Tensors("run_config/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 0 and yaml.safe_load(textwrap.dedent(text)) == description


def test_wandb_requested_but_not_installed_is_a_clear_error_before_any_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets without the package
    with pytest.raises(
        LoggerSetupError, match=r"trainer.loggers includes 'wandb'.*pip install 'megarl\[wandb\]'.*drop 'wandb'"
    ):
        MetricsLogger(tmp_path, ["console", "wandb"], total_steps=3)
    assert not (tmp_path / METRICS_FILE).exists()


def test_unknown_logger_names_the_setting(tmp_path):
    with pytest.raises(LoggerSetupError, match=r"trainer.loggers=\['mlflow'\]: unknown \['mlflow'\]"):
        MetricsLogger(tmp_path, ["mlflow"], total_steps=3)
