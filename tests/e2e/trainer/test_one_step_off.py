"""`trainer.rollout_mode: one_step_off` end to end on CPU: split placement (the actor's two TP ranks on
two slots, the vLLM engine on a third), the engines generating each next batch in the driver's
generation thread while the actor trains, with DAPO (dynamic sampling, the overlong penalty, clip-higher,
token-mean loss) and validation on, in bf16 end to end. A resume from the middle of such a run (the batch
generated ahead, kept in the checkpoint) is the loop's logic: tests/unit/trainer/test_loop_on_fake_cluster.py.

One run for both: DAPO in bf16 (once a job of its own in test_trainer_e2e.py) reads nothing of the
rollout mode, and the one-version lag reads nothing of the dtype or the loss."""

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


ASYNC_STEPS = 3
ASYNC_ARGS = {
    "trainer.rollout_mode": "async",
    "trainer.max_staleness": 2,
    "placement.mode": "split",
    "placement.gpus_per_node": 3,
    "placement.rollout_gpus": 1,
    "trainer.total_steps": ASYNC_STEPS,
    "checkpoint.save_freq": 2,
    "trainer.test_freq": 2,
    "checkpoint.export_hf": "false",
    "rollout.partial_rollout": 1,
}


def test_async_trains_within_the_staleness_bound_and_checkpoints_the_batches_ahead(assets, tmp_path):
    """async with max_staleness 2 and partial rollouts (a token per segment: the quickstart's responses have
    two): the engines run up to three batches ahead in the driver's thread, weight loads, validation and
    checkpoints take them between two segments. The resume from such a checkpoint (on the batch it kept, or
    saying the batch was in flight) is the loop's logic: tests/unit/trainer/test_loop_on_fake_cluster.py."""
    run_dir = tmp_path / "run"
    trainer = Trainer.from_config(QUICKSTART, overrides(assets, run_dir, **ASYNC_ARGS))
    trainer.fit()
    metrics = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, ASYNC_STEPS + 1))
    lags = [m["rollout/policy_version_lag/max"] for m in metrics]
    assert lags[0] == 0 and all(0 <= lag <= 2 for lag in lags) and max(lags) >= 1, lags  # generated ahead, in bound
    assert all(m["rollout/stale_dropped_samples"] == 0 for m in metrics)
    assert all(0 <= m["rollout/token_version_lag/mean"] <= m["rollout/policy_version_lag/max"] for m in metrics)
    # A weight load between a batch's two segments makes every sample of it partial: 16 prompts x 8 samples.
    samples = trainer.config.data.train_batch_size * trainer.config.rollout.n
    assert all(0 <= m["rollout/partial_samples"] <= samples for m in metrics)
    assert [m["sync/weight_version"] for m in metrics] == [1.0, 2.0, 3.0]
    assert [m["step"] for m in metrics if "val/reward/mean" in m] == [2, 3]
    # Step 2's checkpoint took the engines between two segments: step 3's batch (3 - 1 - 2 = 0: any weights
    # will do) was either made by then, by the weights its lag says, or in flight; nothing beyond the last step.
    stream = json.loads((run_dir / "checkpoints" / step_dir_name(2) / "extra.json").read_text())["stream"]
    assert (list(stream["ready"]), stream["in_flight"]) in ((["3"], None), ([], 3)), stream
    if stream["ready"]:
        assert 2 - stream["ready"]["3"]["policy_version"] == lags[2]
