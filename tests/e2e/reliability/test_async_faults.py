"""A `trainer.rollout_mode: async` run (split placement, `trainer.max_staleness` 1: the driver's rollout
thread generates the next step's batch while the actor trains) stopped mid-run.

SIGTERM to the driver: the run ends with the one stop line and the shell's 143, no traceback, no process
or /dev/shm file left; the newest checkpoint holds the batch generated ahead (extra.json's `stream`). What
`checkpoint.resume=auto` does with it (says what it kept, trains the next step on that batch exactly as the
interrupted run did) is the loop's logic: tests/unit/trainer/test_loop_on_fake_cluster.py; a resume of a
real run after a killed driver: tests/e2e/trainer/test_trainer_e2e.py and the soak (test_soak.py).

A rollout engine stopped (SIGSTOP) while the thread generates or waits for the next weights: the run
ends within trainer.hang_timeout_s plus the shutdown, naming the engine, with nothing left running and
its newest checkpoint intact to resume from.

The sync mode's equivalents: test_stop_signals.py, test_stopped_rank.py, test_process_faults.py.
"""

import json
import os
import re
import signal
import time

import psutil
import pytest
from reliability_job import Job

from megarl.trainer.checkpoint_manager import CheckpointManager

pytestmark = pytest.mark.slow  # whole jobs with a fault injected: `-m "not slow"` leaves them out

ASYNC = [
    "trainer.rollout_mode=async",
    "trainer.max_staleness=1",
    "placement.mode=split",
    "placement.gpus_per_node=3",
    "placement.rollout_gpus=1",
    "checkpoint.save_freq=2",
]
STEPS = 6
STARTUP_BOUND_S = 600.0
"""Until step 3 is logged: three workers and an engine start on a machine other jobs share."""
END_BOUND_S = 120.0
"""From the signal to the exit (test_stop_signals' bound)."""
HANG_TIMEOUT_S = 10
SHUTDOWN_BOUND_S = 110.0
"""After the hang is found (test_stopped_rank's bound)."""


def test_sigterm_mid_async_run_ends_cleanly_and_the_checkpoint_keeps_the_batch_ahead(workspace, tmp_path, jobs):
    run_dir = tmp_path / "run"
    args = [f"trainer.total_steps={STEPS}", *ASYNC]
    first = Job.start(workspace, run_dir, args)
    jobs.append(first)
    first.wait_for(lambda: first.last_step() >= 3, "step 3 logged", timeout_s=STARTUP_BOUND_S)
    first.rank_processes()  # note the job's processes, to check they are gone at the end
    os.kill(first.process.pid, signal.SIGTERM)

    assert first.wait(END_BOUND_S) == 143
    out = first.output()
    lines = [line for line in out.splitlines() if line.startswith("megarl train: stopped by")]
    assert len(lines) == 1, out[-3000:]
    assert re.fullmatch(
        r"megarl train: stopped by SIGTERM during step \d+( \(\w+\))?; last checkpoint: step \d+ "
        r"\(.+\); continue from it by running the same command with checkpoint.resume=auto",
        lines[0],
    )
    assert "Traceback" not in out, out[-3000:]
    assert first.leftovers() == []
    assert first.shm.leftovers() == []
    interrupted = first.metrics()
    assert all(m["rollout/policy_version_lag/max"] <= 1 for m in interrupted)

    # The newest checkpoint (verified) kept the batch of the step after it, generated with the weights
    # of the step before it (the thread settled before the save: without partial rollouts none is lost).
    latest = CheckpointManager(first.checkpoint_dir).latest()
    assert f"last checkpoint: step {latest.step} ({latest.path})" in lines[0]
    stream = json.loads((latest.path / "extra.json").read_text())["stream"]
    assert (list(stream["ready"]), stream["in_flight"]) == ([str(latest.step + 1)], None), stream
    assert stream["ready"][str(latest.step + 1)]["policy_version"] == latest.step - 1


def test_stopped_rollout_engine_in_async_mode_ends_the_run_naming_it(workspace, tmp_path, jobs):
    job = Job.start(
        workspace,
        tmp_path / "run",
        ["trainer.total_steps=50", f"trainer.hang_timeout_s={HANG_TIMEOUT_S}", *ASYNC],
    )
    jobs.append(job)
    job.wait_for(lambda: job.last_step() >= 3, "step 3 logged", timeout_s=STARTUP_BOUND_S)
    _, rollout = job.rank_processes()
    assert len(rollout) == 1, rollout
    victim = rollout[0]
    try:
        victim.suspend()
        stopped_at = time.monotonic()
        code = job.wait(HANG_TIMEOUT_S + SHUTDOWN_BOUND_S)
        print(
            f"\nSIGSTOP of the rollout engine (process {victim.pid}) in async mode -> exit {code} after "
            f"{time.monotonic() - stopped_at:.1f} s (trainer.hang_timeout_s = {HANG_TIMEOUT_S})"
        )
    finally:
        _resume_if_alive(victim)

    assert code == 1
    out = job.output()
    failure = re.search(
        rf"megarl train: failed during step (\d+)( \(\w+\))?: WorkerFailure: rollout rank 0 failed:\n"
        rf"\(process {victim.pid} on node [\d.]+\) ranks \[0\] are alive but not running",
        out,
    )
    assert failure, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert job.leftovers() == []
    assert job.shm.leftovers() == []
    failed = int(failure.group(1))
    assert job.metrics()[-1]["step"] == failed - 1
    latest = CheckpointManager(job.checkpoint_dir).latest()
    # The engine's silence is found where the driver next waits on it: at the sync that ends the failed step,
    # after that step's checkpoint (an even step) was saved, or earlier, before it.
    saved_before = failed - 1 - (failed - 1) % 2
    assert latest.step in ({saved_before, failed} if failed % 2 == 0 else {saved_before}), (latest.step, failed)
    assert f"last checkpoint: step {latest.step} ({latest.path})" in out
    assert CheckpointManager(job.checkpoint_dir).resolve_resume("auto").path == latest.path


def _resume_if_alive(process: psutil.Process) -> None:
    """A stopped process ignores every signal but SIGKILL until continued: let the clean-up reach it."""
    try:
        os.kill(process.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
