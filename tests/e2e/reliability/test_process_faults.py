"""A rank process killed mid-run (a policy rank inside the actor update) ends the job promptly, naming the
role, rank, process, node, step and phase, with a non-zero exit, and leaves its newest checkpoint intact
for `checkpoint.resume=auto`.

A crash while a checkpoint is being written (at every point of the save) is covered by the
checkpoint tests: tests/distributed/checkpoint/test_checkpoint_faults.py.
"""

import re
import time

import psutil
import pytest
from reliability_job import Job, failed_run_state, python_stacks

from megarl.trainer.checkpoint_manager import CheckpointManager

pytestmark = pytest.mark.slow  # a whole job with a fault injected: `-m "not slow"` leaves it out

# How long a job may take to notice a dead rank and exit: Ray reports the actor's death within
# seconds; the rest is the driver's shutdown of the other processes and of Ray.
END_BOUND_S = 120.0
# Micro-batches of 2: the update is most of a step, so the kill lands inside step 4's at the first try.
POLICY_OVERRIDES = ["checkpoint.save_freq=2", "actor.micro_batch_size_per_gpu=2"]


def kill(process: psutil.Process) -> None:
    process.kill()
    process.wait(30)


def test_killed_policy_rank_ends_the_job_and_leaves_a_checkpoint_to_resume_from(workspace, tmp_path, jobs):
    run_dir = tmp_path / "run"
    first = Job.start(workspace, run_dir, ["trainer.total_steps=10", *POLICY_OVERRIDES])
    jobs.append(first)
    first.wait_for(lambda: first.last_step() >= 3, "step 3 logged")
    policy, rollout = first.rank_processes()
    assert len(policy) == 2 and len(rollout) == 2, (policy, rollout)
    victim = policy[-1].pid
    first.wait_for(lambda: "update_actor" in python_stacks(victim), "a policy rank inside update_actor")
    kill(policy[-1])
    killed_at = time.monotonic()

    code = first.wait(END_BOUND_S)
    print(
        f"\nSIGKILL of policy rank (process {victim}) in update_actor -> exit {code} after "
        f"{time.monotonic() - killed_at:.1f} s"
    )
    assert code == 1
    out = first.output()
    failure = re.search(
        rf"failed during step (\d+) \(update_actor\): WorkerFailure: policy rank [01] failed:\n"
        rf"\(process {victim} on node [\d.]+\)",
        out,
    )
    assert failure, out[-4000:]
    assert first.leftovers() == []
    failed_step = int(failure.group(1))
    _, latest = failed_run_state(first, failed_step)

    # What `checkpoint.resume=auto` would continue from: the newest checkpoint, intact (every SHA-256
    # checked). That a resume from it trains the steps after it as the interrupted run did is the same
    # path as after a killed driver: tests/e2e/trainer/test_trainer_e2e.py::
    # test_resume_after_killed_driver_matches_uninterrupted_run (and, for the loop's replay of records,
    # data position and optimizer state, tests/unit/trainer/test_loop_on_fake_cluster.py).
    assert CheckpointManager(first.checkpoint_dir).resolve_resume("auto").path == latest.path


def test_killed_rollout_engine_ends_the_job_naming_it(workspace, tmp_path, jobs):
    job = Job.start(workspace, tmp_path / "run", ["trainer.total_steps=50"])
    jobs.append(job)
    job.wait_for(lambda: job.last_step() >= 1, "step 1 logged")
    _, rollout = job.rank_processes()
    assert len(rollout) == 2
    victim = rollout[0].pid
    kill(rollout[0])

    assert job.wait(END_BOUND_S) != 0
    out = job.output()
    assert re.search(
        rf"failed during step \d+ \(\w+\): WorkerFailure: rollout rank [01] failed:\n"
        rf"\(process {victim} on node [\d.]+\)",
        out,
    ), out[-4000:]
    assert job.leftovers() == []
