"""SIGINT (Ctrl-C in a terminal, sent to the whole foreground process group) and SIGHUP (the terminal
closed) end `megarl train` with one line naming the step, the phase, the last checkpoint and how to
continue, the shell's exit code (130 / 129), no traceback, and no process or /dev/shm file left behind;
also with the next step's batch generating in the driver's generation thread (`trainer.rollout_mode:
one_step_off`: the SIGHUP case). The Ctrl-C case runs a TP 2 engine: the signal reaches its vLLM worker
processes too, and those hold most of a run's shared memory (issue 36).

SIGTERM (a scheduler's stop) takes the same path (`megarl.cli.stop_signals`): its whole job is
test_async_faults.py's (an async run), its one line and exit 143 in sync mode the fake cluster's
(tests/unit/trainer/test_loop_on_fake_cluster.py), and `sft`, `convert` and `bench` have theirs in
test_stop_signals_other_commands.py."""

import os
import re
import signal

import pytest
from reliability_job import Job

pytestmark = pytest.mark.slow  # a whole job with a fault injected: `-m "not slow"` leaves it out

END_BOUND_S = 120.0
ONE_STEP_OFF = [
    "trainer.rollout_mode=one_step_off",
    "placement.mode=split",
    "placement.gpus_per_node=3",
    "placement.rollout_gpus=1",
]
"""A generation is in flight for most of every step after the first (the engine on a slot of its own)."""


@pytest.mark.parametrize(
    "signum,to_group,mode",
    [
        (signal.SIGINT, True, ["rollout.tensor_model_parallel_size=2"]),
        (signal.SIGHUP, False, ONE_STEP_OFF),
    ],
    ids=["SIGINT-rollout-TP2", "SIGHUP-one-step-off"],
)
def test_a_stop_signal_ends_the_run_with_one_line(workspace, tmp_path, jobs, signum, to_group, mode):
    job = Job.start(workspace, tmp_path / "run", ["trainer.total_steps=50", "checkpoint.save_freq=2", *mode])
    jobs.append(job)
    job.wait_for(lambda: job.last_step() >= 3, "step 3 logged")
    if mode == ONE_STEP_OFF:  # step 3 trained beside step 4's generation, and so does every later step
        assert job.metrics()[2]["rollout/policy_version_lag/max"] == 1
    job.rank_processes()  # note the job's processes, to check they are gone at the end
    (os.killpg if to_group else os.kill)(job.process.pid, signum)

    assert job.wait(END_BOUND_S) == 128 + signum
    out = job.output()
    name = signal.Signals(signum).name
    lines = [line for line in out.splitlines() if line.startswith("megarl train: stopped by")]
    assert len(lines) == 1, out[-3000:]
    assert re.fullmatch(
        rf"megarl train: stopped by {name} during step \d+( \(\w+\))?; last checkpoint: step \d+ "
        r"\(.+\); continue from it by running the same command with checkpoint.resume=auto",
        lines[0],
    )
    assert "Traceback" not in out, out[-3000:]
    assert job.leftovers() == []
    assert job.shm.leftovers() == []
