"""`trainer.rollout_mode: one_step_off` end to end on CPU: split placement (the actor's two TP ranks on
two slots, the vLLM engine on a third), the engines generating each next batch in the driver's
generation thread while the actor trains, with DAPO's dynamic sampling and validation on. A resume from
the middle of such a run (the batch generated ahead, kept in the checkpoint) is the loop's logic:
tests/unit/trainer/test_loop_on_fake_cluster.py."""

import json

from megarl import Trainer
from megarl.workers.checkpoint_files import step_dir_name

from .conftest import QUICKSTART, overrides, read_metrics

STEPS = 4
ARGS = {
    "trainer.rollout_mode": "one_step_off", "placement.mode": "split", "placement.gpus_per_node": 3,
    "placement.rollout_gpus": 1, "trainer.total_steps": STEPS, "checkpoint.save_freq": 2, "trainer.test_freq": 2,
    "algorithm.dynamic_sampling.enable": "true", "algorithm.dynamic_sampling.max_rounds": 20,
    "checkpoint.export_hf": "false",
}


def test_one_step_off_trains_one_version_behind(assets, tmp_path):
    run_dir = tmp_path / "run"
    trainer = Trainer.from_config(QUICKSTART, overrides(assets, run_dir, **ARGS))
    trainer.fit()
    metrics = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # Step 1 trains on a batch of the initial weights; every later one on a batch generated while the
    # step before trained, by the weights one sync behind the actor's (a sync run would log 0 throughout).
    assert [m["rollout/policy_version_lag/max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert [m["rollout/policy_version_lag/mean"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert [m["sync/weight_version"] for m in metrics] == [1.0, 2.0, 3.0, 4.0]
    assert all(m["dapo/rounds"] >= 1 and m["reward/std"] > 0 and m["timing/rollout"] > 0 for m in metrics)
    assert [m["step"] for m in metrics if "val/reward/mean" in m] == [2, 4]
    # Step 2's checkpoint holds step 3's batch, generated beside step 2 with step 1's weights.
    extra = json.loads((run_dir / "checkpoints" / step_dir_name(2) / "extra.json").read_text())
    assert extra["stream"]["ahead"]["policy_version"] == 1
    assert json.loads((run_dir / "checkpoints" / step_dir_name(4) / "extra.json").read_text())["stream"] == {"ahead": None}
