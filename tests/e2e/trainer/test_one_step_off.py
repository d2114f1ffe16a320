"""`trainer.rollout_mode: one_step_off` end to end on CPU: split placement (the actor's two TP ranks on
two slots, the vLLM engine on a third), the engines generating each next batch in the driver's
generation thread while the actor trains, with DAPO (dynamic sampling, the overlong penalty, clip-higher,
token-mean loss) and validation on, in bf16 end to end. A resume from the middle of such a run (the batch
generated ahead, kept in the checkpoint) is the loop's logic: tests/unit/trainer/test_loop_on_fake_cluster.py.

One run for both: DAPO in bf16 (once a job of its own in test_trainer_e2e.py) reads nothing of the
rollout mode, and the one-version lag reads nothing of the dtype or the loss.

`trainer.rollout_mode: async` has its whole jobs elsewhere: tests/e2e/trainer/test_agent_quickstart.py
(partial rollouts, weight loads between a turn's segments, the lag bound) and
tests/e2e/reliability/test_async_faults.py (a stop, the checkpoint keeping the batch ahead); its loop
logic (the staleness bound, validation and checkpoints between segments, the resume on the kept batches)
runs on the fake cluster (tests/unit/trainer/test_loop_on_fake_cluster.py)."""

import json

import torch
from safetensors.torch import load_file

from megarl import Trainer
from megarl.workers.checkpoint_files import step_dir_name

from .conftest import QUICKSTART, overrides, read_metrics

STEPS = 4
ARGS = {
    "trainer.rollout_mode": "one_step_off",
    "placement.mode": "split",
    "placement.gpus_per_node": 3,
    "placement.rollout_gpus": 1,
    "trainer.total_steps": STEPS,
    "checkpoint.save_freq": 2,
    "trainer.test_freq": 2,
    "algorithm.dynamic_sampling.enable": "true",
    "algorithm.dynamic_sampling.max_rounds": 20,
    # DAPO in bf16: the actor trains bf16 parameters (fp32 main copies), the engines run bf16, and every
    # sync is checked bit for bit (the exact check) and by the bf16 log-prob gap threshold.
    "model.dtype": "bfloat16",
    "algorithm.overlong.enable": "true",
    "algorithm.overlong.buffer_length": 1,
    "algorithm.overlong.penalty_factor": 0.1,
    "actor.clip_ratio_high": 0.28,
    "actor.loss_agg_mode": "token-mean",
}


def test_one_step_off_trains_one_version_behind_with_dapo_in_bf16(assets, tmp_path):
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
    assert json.loads((run_dir / "checkpoints" / step_dir_name(4) / "extra.json").read_text())["stream"] == {
        "ahead": None
    }
    for m in metrics:
        # Groups with all-equal rewards were dropped and more prompts rolled out until 16 groups had signal.
        assert 0 < m["dapo/groups_kept_ratio"] <= 1 and m["actor/grad_norm"] > 0
        assert m["sync/checksum_tensors"] > 0 and m["sync/logprob_max_abs_diff"] <= trainer.cluster.sync.threshold
    # The actor trained bf16 parameters: its export holds them as they are.
    exported = load_file(run_dir / "checkpoints" / "hf" / "model.safetensors")
    assert {tensor.dtype for tensor in exported.values()} == {torch.bfloat16}
