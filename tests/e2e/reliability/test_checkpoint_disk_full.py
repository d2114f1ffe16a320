"""checkpoint.dir filling up between two saves of a run: the next save fails with an error naming the
step's directory and ENOSPC, the job ends (non-zero), no temp dir is left, the previous checkpoint stays
complete and is the one `checkpoint.resume=auto` picks once space is freed.

The checkpoint code's own no-space handling is covered by tests/distributed/checkpoint/test_checkpoint_faults.py;
this is the same through a whole job, on a real full file system: a small tmpfs (needs CAP_SYS_ADMIN,
skipped without it), filled by a file once the first checkpoint is complete. It is the suite's one whole
job of a failed save: a checkpoint.dir turning read-only takes the same path from the save's OSError on
(CheckpointError, the job's end, the previous checkpoint kept; once test_checkpoint_dir_faults.py's job of
its own), and its EROFS message is test_checkpoint_faults.py's ("EROFS creating the dir").
"""

import errno
import re
import subprocess
import time

import pytest
from reliability_job import Job

from megarl.trainer.checkpoint_manager import CheckpointManager
from megarl.workers.checkpoint_files import read_manifest

pytestmark = pytest.mark.slow  # a whole job with a fault injected: `-m "not slow"` leaves it out

TMPFS_SIZE = "48m"
"""Room for a few checkpoints of the tiny model (about 5 MB each) and the filler."""
OVERRIDES = ["checkpoint.save_freq=2"]


def fill(directory) -> None:
    """Write zeros into `directory`/filler until the file system has no space left."""
    chunk = bytes(1 << 20)
    with open(directory / "filler", "wb") as filler:
        try:
            while True:
                filler.write(chunk)
                filler.flush()
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
    # The last partial chunk may leave a few bytes free; a checkpoint needs megabytes.


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted where the job's checkpoint.dir will be; unmounted after the test."""
    directory = tmp_path / "run" / "checkpoints"
    directory.mkdir(parents=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {mount.stderr.strip()}")
    yield directory
    subprocess.run(["umount", "--lazy", str(directory)], check=True)


def test_full_disk_fails_the_save_and_auto_resume_picks_the_previous_checkpoint(workspace, tmp_path, jobs, small_disk):
    run_dir = tmp_path / "run"
    first = Job.start(workspace, run_dir, ["trainer.total_steps=8", *OVERRIDES])
    jobs.append(first)
    manager = CheckpointManager(small_disk)
    first.wait_for(lambda: manager.latest() is not None, "the first checkpoint complete")
    fill(small_disk)
    filled_at = time.monotonic()

    code = first.wait()
    print(
        f"\ncheckpoint.dir full after step {manager.latest().step}'s save -> exit {code} after "
        f"{time.monotonic() - filled_at:.1f} s"
    )
    assert code == 1
    out = first.output()
    saved = manager.complete()
    assert saved, "the checkpoint saved before the disk filled must stay complete"
    read_manifest(saved[-1].path)
    failed_step = saved[-1].step + 2
    # Saves happen before a step is logged: the failed one is the step after the last logged.
    logged = first.metrics()
    assert logged[-1]["step"] == failed_step - 1, "the run must stop at the first failed save"
    assert re.search(
        rf"saving checkpoint {small_disk}/step_{failed_step:08d} failed .*No space left on device \(ENOSPC\)", out
    ), out[-4000:]
    print(next(line for line in out.splitlines() if "CheckpointError:" in line))
    assert [p.name for p in small_disk.iterdir() if ".tmp-" in p.name] == []
    assert first.leftovers() == []

    (small_disk / "filler").unlink()
    # Once space is freed, `checkpoint.resume=auto` continues from the checkpoint saved before the disk
    # filled, intact (every SHA-256 checked). That a resume trains the steps after it as the interrupted
    # run did is the same path as after a killed driver: tests/e2e/trainer/test_trainer_e2e.py::
    # test_resume_after_killed_driver_matches_uninterrupted_run (and tests/unit/trainer/test_loop_on_fake_cluster.py).
    assert manager.resolve_resume("auto").path == saved[-1].path
