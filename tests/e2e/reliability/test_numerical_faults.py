"""Numerical faults stop a run with a message naming the setting (or the reward function), before a bad
model is used.

The skip itself (a NaN loss or gradient skips the optimizer step on every rank, weights unchanged)
is tested at the worker level: tests/distributed/workers/test_megatron_workers.py::
test_nan_loss_skips_the_step_and_keeps_the_weights. Here the trainer's side: consecutive skipped
steps end the run, and a sync whose log-prob gap is over the threshold ends it before the next rollout.
"""

import re

import pytest

from reliability_job import Job


@pytest.fixture
def job_runner(workspace, tmp_path):
    jobs = []

    def run(overrides, env=None):
        job = Job.start(workspace, tmp_path / f"run{len(jobs)}", overrides, env=env)
        jobs.append(job)
        return job

    yield run
    for job in jobs:
        job.cleanup()


def test_consecutive_nan_steps_stop_the_run_naming_max_bad_steps(workspace, job_runner):
    # Valid float32 rewards whose group sums overflow: NaN advantages, a NaN loss on every step. The
    # weights never change, so the syncs stay verified and only the bad-step count can stop the run.
    job = job_runner(["reward.function=reliability_rewards:group_sum_overflow", "trainer.max_bad_steps=2",
                      "trainer.total_steps=6"], env={"PYTHONPATH": str(workspace)})
    code = job.wait()
    out = job.output()
    assert code == 1
    assert "BadStepsError" in out and "trainer.max_bad_steps=2" in out, out[-3000:]
    records = job.metrics()
    assert [r["step"] for r in records] == [1, 2], "the run must stop right after the 2nd bad step"
    assert all(r["actor/skipped_steps"] >= 1 and r["actor/optimizer_steps"] == r["actor/skipped_steps"] for r in records)
    assert job.leftovers() == []


def test_a_reward_beyond_float32_stops_the_run_at_scoring(workspace, job_runner):
    job = job_runner(["reward.function=reliability_rewards:beyond_float32", "trainer.total_steps=3"],
                     env={"PYTHONPATH": str(workspace)})
    code = job.wait()
    out = job.output()
    assert code == 2, out[-3000:]
    # The message names the function, the value, the sample's index in the batch and its response.
    assert re.search(r"megarl train: reward.function 'reliability_rewards:beyond_float32' returned 1e\+39 \(float\) "
                     r"as score \d+; .*float32.*; the response it scored: '.+'", out), out[-3000:]
    assert job.metrics() == [], "no step may train on a reward the trainer cannot hold"
    assert job.leftovers() == []


def test_sync_gap_over_threshold_stops_before_the_next_rollout(job_runner):
    # The smallest positive threshold: the TP-2 actor and the TP-1 engine reduce in another order,
    # so their probe log-probs differ by ~1e-7 (measured) and the first sync must fail.
    job = job_runner(["rollout.sync.logprob_gap_threshold=1e-30", "trainer.total_steps=3"])
    code = job.wait()
    out = job.output()
    assert code != 0
    assert "SyncVerificationError" in out, out[-3000:]
    assert "weight sync train TP=2/PP=1 → rollout TP=1" in out, out[-3000:]
    assert "threshold 1e-30" in out
    # The failing sync is the end of step 1: no step was logged, so no rollout used the synced weights.
    assert job.metrics() == []
    assert job.leftovers() == []
