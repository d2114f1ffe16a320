"""A rollout engine killed mid-run ends the job promptly, naming the role, rank, process, node and step,
with a non-zero exit and nothing left running.

A policy rank killed inside the actor update (its TP peer waiting for it in a collective) is the short
soak's phase 1 (test_soak.py: the job's end, its one line, and the resume from its newest checkpoint).
A crash while a checkpoint is being written (at every point of the save) is covered by the
checkpoint tests: tests/distributed/checkpoint/test_checkpoint_faults.py.
"""

import re

import psutil
import pytest
from reliability_job import Job

pytestmark = pytest.mark.slow  # a whole job with a fault injected: `-m "not slow"` leaves it out

# How long a job may take to notice a dead rank and exit: Ray reports the actor's death within
# seconds; the rest is the driver's shutdown of the other processes and of Ray.
END_BOUND_S = 120.0


def kill(process: psutil.Process) -> None:
    process.kill()
    process.wait(30)


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
