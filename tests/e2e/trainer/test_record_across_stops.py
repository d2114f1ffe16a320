"""A run stopped after step 4's checkpoint but before step 4's metrics record: resumed, it writes that
record from the checkpoint, and metrics.jsonl holds exactly one record per step (issue 18 item 4)."""

import pytest

import megarl.trainer.trainer as trainer_module
from megarl import Trainer

from .conftest import QUICKSTART, overrides, read_metrics


class StopAfterCheckpoint(RuntimeError):
    pass


def test_exactly_one_record_per_step_when_a_stop_falls_between_checkpoint_and_record(assets, tmp_path, monkeypatch):
    args = overrides(assets, tmp_path, **{"trainer.total_steps": 4, "checkpoint.save_freq": 2,
                                          "checkpoint.export_hf": "false"})
    to_rollout = trainer_module.HandOver.to_rollout

    def stop_at_step_4(self, step):  # runs right after the step's checkpoint, before its record
        if step == 4:
            raise StopAfterCheckpoint
        return to_rollout(self, step)

    monkeypatch.setattr(trainer_module.HandOver, "to_rollout", stop_at_step_4)
    first = Trainer.from_config(QUICKSTART, args)
    with pytest.raises(StopAfterCheckpoint):
        first.fit()
    assert [m["step"] for m in read_metrics(first.run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert first.checkpoints.latest().step == 4
    monkeypatch.undo()

    resumed = Trainer.from_config(QUICKSTART, [*args, "trainer.total_steps=6", "checkpoint.resume=auto"])
    resumed.fit()
    metrics = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    # Step 4's record is what the step had measured when it saved: its rollout and update, not what came after.
    assert {"reward/mean", "actor/pg_loss"} <= set(metrics[3]) and "timing/sync" not in metrics[3]
