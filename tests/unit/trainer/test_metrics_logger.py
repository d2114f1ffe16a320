"""The MetricsLogger facade: built from the run's config and batch plan, fanning out to the sinks
(the W&B sink with the real client: test_metrics_wandb.py)."""

import dataclasses
import json

from megarl.config.batch_plan import plan_batches
from megarl.config.config import Config, to_dict
from megarl.config.sections import TrainerConfig
from megarl.trainer.sinks import CURVES_FILE, METRICS_FILE, RUN_CONFIG_FILE, MetricsLogger, read_metrics_file


def test_from_config_writes_to_output_dir_slash_experiment_name_with_the_run_config(tmp_path, capsys):
    trainer = TrainerConfig(output_dir=str(tmp_path), experiment_name="grpo-tiny", loggers=("console", "jsonl"))
    config = dataclasses.replace(Config(), trainer=trainer)
    plan = plan_batches(config)
    with MetricsLogger.from_config(config, plan, total_steps=2) as metrics_logger:
        metrics_logger.log(1, {"reward/mean": 0.25})
        metrics_logger.log(2, {"reward/mean": 0.5})
    run_dir = tmp_path / "grpo-tiny"
    assert [record["reward/mean"] for record in read_metrics_file(run_dir / METRICS_FILE)] == [0.25, 0.5]
    assert (run_dir / CURVES_FILE).is_file()
    # The resolved config's sections and the batch plan, once, beside metrics.jsonl.
    described = json.loads((run_dir / RUN_CONFIG_FILE).read_text())
    assert described == to_dict(config) | {"batch_plan": to_dict(plan)}
    assert described["batch_plan"]["samples_per_step"] == plan.samples_per_step
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[:2] for line in lines] == [["step 1/2", "reward 0.25"], ["step 2/2", "reward 0.5"]]


def test_jsonl_is_written_even_when_not_listed(tmp_path, capsys):
    with MetricsLogger(tmp_path, ["console"], total_steps=1) as metrics_logger:
        metrics_logger.log(1, {"reward/mean": 1.0})
    assert read_metrics_file(tmp_path / METRICS_FILE) == [{"step": 1, "reward/mean": 1.0}]


def test_restore_writes_the_checkpoints_record_only_when_the_file_lacks_it(tmp_path):
    """A run stopped between a checkpoint (step 4) and its record: the resumed run writes step 4's record
    from the checkpoint, so every step has exactly one; a file that has it is left alone."""
    import json

    from megarl.trainer.sinks import MetricsLogger

    with MetricsLogger(tmp_path, ["jsonl"], total_steps=6) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": float(step)})
    with MetricsLogger(tmp_path, ["jsonl"], total_steps=6, resumed_step=4) as logger:
        assert logger.restore(4, {"reward/mean": 4.0})
        assert not logger.restore(4, {"reward/mean": 40.0})
        logger.log(5, {"reward/mean": 5.0})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0)]
