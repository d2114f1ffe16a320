"""The MetricsLogger facade: built from the trainer config, fanning out to the sinks; the W&B sink's side
of the wandb API (a stand-in module: wandb is not installed here)."""

import sys
import types

from megarl.config.sections import TrainerConfig
from megarl.trainer.sinks import CURVES_FILE, METRICS_FILE, MetricsLogger, read_metrics_file


def test_from_config_writes_to_output_dir_slash_experiment_name(tmp_path, capsys):
    trainer = TrainerConfig(output_dir=str(tmp_path), experiment_name="grpo-tiny", loggers=("console", "jsonl"))
    with MetricsLogger.from_config(trainer, total_steps=2) as metrics_logger:
        metrics_logger.log(1, {"reward/mean": 0.25})
        metrics_logger.log(2, {"reward/mean": 0.5})
    run_dir = tmp_path / "grpo-tiny"
    assert [record["reward/mean"] for record in read_metrics_file(run_dir / METRICS_FILE)] == [0.25, 0.5]
    assert (run_dir / CURVES_FILE).is_file()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[:2] for line in lines] == [["step 1/2", "reward 0.25"], ["step 2/2", "reward 0.5"]]


def test_jsonl_is_written_even_when_not_listed(tmp_path, capsys):
    with MetricsLogger(tmp_path, ["console"], total_steps=1) as metrics_logger:
        metrics_logger.log(1, {"reward/mean": 1.0})
    assert read_metrics_file(tmp_path / METRICS_FILE) == [{"step": 1, "reward/mean": 1.0}]


class _FakeWandb(types.ModuleType):
    """The part of the wandb API the sink uses: `init(...)` -> run with `log(dict, step=)`, `finish()`;
    `util.generate_id()`."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0
        self.util = types.SimpleNamespace(generate_id=lambda: f"id{len(self.inits)}")

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, metrics, step):
                fake.logged.append((step, metrics))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_sink_logs_by_step_and_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    wandb = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    with MetricsLogger(tmp_path, ["wandb"], total_steps=3, project_name="proj", experiment_name="exp") as first:
        first.log(1, {"reward/mean": 0.5})
    with MetricsLogger(tmp_path, ["wandb"], total_steps=3, project_name="proj", experiment_name="exp",
                       resumed_step=1) as resumed:
        resumed.log(2, {"reward/mean": 0.75})
    assert [init["id"] for init in wandb.inits] == ["id0", "id0"]
    assert wandb.inits[0] == dict(project="proj", name="exp", id="id0", dir=str(tmp_path), resume="allow")
    assert wandb.logged == [(1, {"reward/mean": 0.5}), (2, {"reward/mean": 0.75})]
    assert wandb.finished == 2


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
