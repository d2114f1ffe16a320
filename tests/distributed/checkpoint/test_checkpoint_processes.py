"""A save leaves no process behind: megatron's writer processes end with it, and nothing resident
(such as a `multiprocessing` Manager per rank) piles up or lingers across saves."""

import psutil
from checkpoint_toy import ToyJob

from megarl.parallel.spawn import run_distributed

SAVES = 3


def _children_around_saves(root: str) -> tuple[list[int], list[list[int]]]:
    """This rank's live descendant pids before any save, and after each of `SAVES` saves."""
    from megarl.workers.checkpoint import save_checkpoint

    job = ToyJob(2, seed=1, use_distributed_optimizer=False)
    me = psutil.Process()

    def children() -> list[int]:
        return sorted(p.pid for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE)

    before, after = children(), []
    for step in range(1, SAVES + 1):
        job.train_step()
        save_checkpoint(root, step, job.groups, **job.parts(), extra={"step": step})
        after.append(children())
    return before, after


def test_saves_leave_no_helper_process(tmp_path):
    for rank, (before, after) in enumerate(run_distributed(_children_around_saves, 2, str(tmp_path), timeout_s=300)):
        assert after == [before] * SAVES, f"rank {rank}: children {before} before the saves, then {after}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_{s:08d}" for s in range(1, SAVES + 1)]
