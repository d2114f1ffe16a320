"""A policy rank that is alive but stopped (SIGSTOP) in the middle of the actor update, its peer waiting
for it in a tensor-parallel all-reduce: the run ends within trainer.hang_timeout_s plus the shutdown,
naming the role, rank, process, node, step and phase, with no process left behind (the stopped one
included) and the last checkpoint intact. That `checkpoint.resume=auto` then continues exactly is the
same path as after a killed rank (the short soak, test_soak.py), not run again here."""

import os
import re
import signal
import time

import psutil
import pytest
from reliability_job import Job, failed_run_state, python_stacks

pytestmark = pytest.mark.slow  # a whole job with a fault injected: `-m "not slow"` leaves it out

HANG_TIMEOUT_S = 10
SHUTDOWN_BOUND_S = 110.0
"""After the hang is found: the group's kill (Ray's raylet SIGKILLs a stopped worker after its grace) and
the driver's shutdown of the other processes and of Ray (as the bound for a dead rank, soak.KILL_TO_EXIT_S)."""
# Micro-batches of 2: the update is most of a step, so the stop lands inside it at the first try.
OVERRIDES = ["checkpoint.save_freq=2", "actor.micro_batch_size_per_gpu=2"]


def test_stopped_policy_rank_ends_the_run_within_the_hang_timeout(workspace, tmp_path, jobs):
    run_dir = tmp_path / "run"
    first = Job.start(
        workspace, run_dir, ["trainer.total_steps=10", f"trainer.hang_timeout_s={HANG_TIMEOUT_S}", *OVERRIDES]
    )
    jobs.append(first)
    first.wait_for(lambda: first.last_step() >= 3, "step 3 logged")
    policy, _ = first.rank_processes()
    victim = policy[-1]
    try:
        first.wait_for(lambda: "update_actor" in python_stacks(victim.pid), "a policy rank inside update_actor")
        victim.suspend()
        stopped_at = time.monotonic()
        code = first.wait(HANG_TIMEOUT_S + SHUTDOWN_BOUND_S)
        print(
            f"\nSIGSTOP of policy rank (process {victim.pid}) in update_actor -> exit {code} after "
            f"{time.monotonic() - stopped_at:.1f} s (trainer.hang_timeout_s = {HANG_TIMEOUT_S})"
        )
    finally:
        _resume_if_alive(victim)

    assert code == 1
    out = first.output()
    failure = re.search(
        rf"megarl train: failed during step (\d+) \(update_actor\): WorkerFailure: policy rank [01] "
        rf"failed:\n\(process {victim.pid} on node [\d.]+\) ranks \[[01]\] are alive but not running",
        out,
    )
    assert failure, out[-4000:]
    print(out[failure.start() :].split("\n\n")[0])
    assert "Traceback" not in out, out[-4000:]
    assert first.leftovers() == []
    _, latest = failed_run_state(first, int(failure.group(1)))
    assert f"last checkpoint: step {latest.step} ({latest.path})" in out


def _resume_if_alive(process: psutil.Process) -> None:
    """A stopped process ignores every signal but SIGKILL until continued: let the clean-up reach it."""
    try:
        os.kill(process.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
