"""Numerical faults stop a run with a message naming the setting (or the reward function), before a bad
model is used.

The skip itself (a NaN loss or gradient skips the optimizer step on every rank, weights unchanged)
is tested at the worker level: tests/distributed/workers/test_megatron_workers.py::
test_nan_loss_skips_the_step_and_keeps_the_weights. The trainer's side of it (consecutive skipped steps
end the run, naming trainer.max_bad_steps) and a reward beyond float32 stopping the run at scoring are the
loop's logic, run on the fake cluster: tests/unit/trainer/test_loop_on_fake_cluster.py. Here what only the
real workers show: a sync whose log-prob gap is over the threshold ends the run before the next rollout.
"""

import pytest
from reliability_job import Job

pytestmark = pytest.mark.slow  # a whole job with a fault injected: `-m "not slow"` leaves it out


@pytest.fixture
def job_runner(workspace, tmp_path):
    jobs = []

    def run(overrides):
        job = Job.start(workspace, tmp_path / f"run{len(jobs)}", overrides)
        jobs.append(job)
        return job

    yield run
    for job in jobs:
        job.cleanup()


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
