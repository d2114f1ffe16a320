"""SIGINT (Ctrl-C in a terminal, sent to the whole foreground process group) ends `megarl train` with one
line naming the step, the phase, the last checkpoint and how to continue, the shell's exit code (130), no
traceback, and no process or /dev/shm file left behind. It runs a TP 2 engine: the signal reaches its vLLM
worker processes too, and those hold most of a run's shared memory (issue 36).

SIGTERM (a scheduler's stop) and SIGHUP (the terminal closed) take the same path (`megarl.cli.stop_signals`):
SIGTERM's whole job with the next batches generating in the driver's rollout thread is test_async_faults.py's
(an async run); the one line and exit code of SIGTERM in sync mode and of SIGHUP with the next step's batch
generating beside the step (`trainer.rollout_mode: one_step_off`, once a whole job here) are the fake
cluster's (tests/unit/trainer/test_loop_on_fake_cluster.py); `sft`, `convert` and `bench` have theirs in
test_stop_signals_other_commands.py."""

import os
import re
import signal

import pytest
from reliability_job import Job

pytestmark = pytest.mark.slow  # a whole job with a fault injected: `-m "not slow"` leaves it out

END_BOUND_S = 120.0


def test_ctrl_c_ends_the_run_with_one_line(workspace, tmp_path, jobs):
    job = Job.start(
        workspace,
        tmp_path / "run",
        ["trainer.total_steps=50", "checkpoint.save_freq=2", "rollout.tensor_model_parallel_size=2"],
    )
    jobs.append(job)
    job.wait_for(lambda: job.last_step() >= 3, "step 3 logged")
    job.rank_processes()  # note the job's processes, to check they are gone at the end
    os.killpg(job.process.pid, signal.SIGINT)

    assert job.wait(END_BOUND_S) == 128 + signal.SIGINT
    out = job.output()
    lines = [line for line in out.splitlines() if line.startswith("megarl train: stopped by")]
    assert len(lines) == 1, out[-3000:]
    assert re.fullmatch(
        r"megarl train: stopped by SIGINT during step \d+( \(\w+\))?; last checkpoint: step \d+ "
        r"\(.+\); continue from it by running the same command with checkpoint.resume=auto",
        lines[0],
    )
    assert "Traceback" not in out, out[-3000:]
    assert job.leftovers() == []
    assert job.shm.leftovers() == []
