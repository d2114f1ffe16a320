"""A rank process killed mid-run ends the job promptly, naming the role and rank, with a non-zero exit;
`checkpoint.resume=auto` then continues from the newest complete checkpoint.

A crash while a checkpoint is being written (at every point of the save) is covered by the
checkpoint tests: tests/distributed/checkpoint/test_checkpoint_faults.py.
"""

import re

import psutil

from megarl.trainer.checkpoint_manager import CheckpointManager
from reliability_job import Job

# How long a job may take to notice a dead rank and exit: Ray reports the actor's death within
# seconds; the rest is the driver's shutdown of the other processes and of Ray.
END_BOUND_S = 120.0


def kill(process: psutil.Process) -> None:
    process.kill()
    process.wait(30)


def test_killed_policy_rank_ends_the_job_and_auto_resume_continues(workspace, tmp_path, jobs):
    run_dir = tmp_path / "run"
    first = Job.start(workspace, run_dir, ["trainer.total_steps=10", "checkpoint.save_freq=2"])
    jobs.append(first)
    first.wait_for(lambda: first.last_step() >= 3, "step 3 logged")
    policy, rollout = first.rank_processes()
    assert len(policy) == 2 and len(rollout) == 2, (policy, rollout)
    victim = policy[-1].pid
    kill(policy[-1])

    assert first.wait(END_BOUND_S) != 0
    out = first.output()
    assert re.search(rf"failed during step \d+ \(\w+\): WorkerFailure: policy rank [01] failed:\n"
                     rf"\(process {victim} on node [\d.]+\)", out), out[-4000:]
    assert first.leftovers() == []
    logged = first.metrics()
    latest = CheckpointManager(first.checkpoint_dir).latest()
    assert latest is not None and latest.step >= 2 and latest.step % 2 == 0 and latest.step <= logged[-1]["step"] + 1

    second = Job.start(workspace, run_dir, ["trainer.total_steps=6", "checkpoint.save_freq=2",
                                            "checkpoint.resume=auto"])
    jobs.append(second)
    assert second.wait() == 0, second.output()[-4000:]
    resumed = second.metrics()
    # Records up to the checkpoint are the first run's, untouched; the rest were trained again.
    assert resumed[:latest.step] == [r for r in logged if r["step"] <= latest.step]
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert CheckpointManager(second.checkpoint_dir).latest().step == 6
    assert second.leftovers() == []


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
    assert re.search(rf"failed during step \d+ \(\w+\): WorkerFailure: rollout rank [01] failed:\n"
                     rf"\(process {victim} on node [\d.]+\)", out), out[-4000:]
    assert job.leftovers() == []
