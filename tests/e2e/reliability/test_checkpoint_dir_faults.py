"""checkpoint.dir turning read-only in the middle of a run: the next save fails with an error naming the
directory and the OS reason, the job ends (non-zero), and the previous checkpoint stays complete.

Save failures inside the checkpoint code (no space, permissions, a crash at each point of a save) are
covered by tests/distributed/checkpoint/test_checkpoint_faults.py; this is the same through a whole job.
The directory is made read-only with a read-only bind mount in the job's mount namespace (root ignores
permission bits), so the test needs CAP_SYS_ADMIN and is skipped without it.
"""

import subprocess

import pytest
from reliability_job import Job

from megarl.trainer.checkpoint_manager import CheckpointManager
from megarl.workers.checkpoint_files import read_manifest

pytestmark = pytest.mark.slow  # a whole job with a fault injected: `-m "not slow"` leaves it out


def mount_read_only(directory, pid: int) -> bool:
    """Bind-mount `directory` onto itself read-only in the mount namespace of process `pid`; False where this
    process may not mount. The job runs in a mount namespace of its own (its private /dev/shm,
    `tests/shm_testing.py`) whose propagation is private, so a mount made here would never reach it; the
    bind lives and ends with the job's namespace, and the test's own view of the directory stays writable."""
    enter = ["nsenter", "--target", str(pid), "--mount"]
    bind = subprocess.run([*enter, "mount", "--bind", str(directory), str(directory)], capture_output=True)
    if bind.returncode != 0:
        return False
    return (
        subprocess.run([*enter, "mount", "-o", "remount,bind,ro", str(directory)], capture_output=True).returncode == 0
    )


def test_read_only_checkpoint_dir_mid_run_fails_the_save_and_keeps_the_last_checkpoint(workspace, tmp_path):
    job = Job.start(workspace, tmp_path / "run", ["trainer.total_steps=6", "checkpoint.save_freq=2"])
    try:
        job.wait_for(lambda: job.last_step() >= 2, "step 2 logged")
        if not mount_read_only(job.checkpoint_dir, job.process.pid):
            pytest.skip("cannot make a read-only bind mount here (needs CAP_SYS_ADMIN)")
        code = job.wait()
        out = job.output()
        assert code != 0
        assert "CheckpointError" in out and str(job.checkpoint_dir) in out and "Read-only file system" in out, out[
            -4000:
        ]
        complete = CheckpointManager(job.checkpoint_dir).complete()
        assert complete and complete[0].step == 2, "the checkpoint saved before the mount must stay complete"
        read_manifest(complete[-1].path)
        # Saves happen before a step is logged: the failed one is the step after the last logged.
        assert job.last_step() == complete[-1].step + 1, "the run must stop at the first failed save"
        assert job.leftovers() == []
    finally:
        job.cleanup()
