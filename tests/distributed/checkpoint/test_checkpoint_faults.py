"""A save that is killed or hits a disk error never costs the previous checkpoint, and a partial one
is never picked up; rotation keeps the newest; the final actor exports to HF.

One single-rank world does it all (spawns are the cost): it saves step 1, meets disk errors saving
step 3, saves step 2 once per fault point with `MEGARL_CHECKPOINT_FAULT` set, stopping dead there
(no cleanup runs: the disk is left as a kill at that point leaves it), then saves step 2 for real,
rotates, reloads and exports. Disk errors are OSErrors raised from the file system calls of the
save (tests run as root, so permissions cannot make a directory read-only), plus a real one: a
checkpoint dir under a regular file.
"""

import builtins
import errno
import hashlib
import json
import os
import pathlib
from pathlib import Path

import pytest
from checkpoint_toy import TINY_QWEN2, ToyJob

from megarl.parallel.spawn import run_distributed
from megarl.trainer.checkpoint_manager import CheckpointManager
from megarl.workers.checkpoint_files import FAULT_ENV, FAULT_POINTS, InjectedFault


def _digests(step_dir: Path) -> dict[str, str]:
    return {
        p.relative_to(step_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(step_dir.rglob("*"))
        if p.is_file()
    }


def _tmp_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name)


def _killed_saves(job: ToyJob, root: Path) -> dict:
    """Save step 2 once per fault point, stopping dead there (no cleanup, as a kill would)."""
    from megarl.workers.checkpoint import save_checkpoint

    manager = CheckpointManager(root)
    results = {}
    for point in FAULT_POINTS:
        before = _digests(manager.latest().path)
        os.environ[FAULT_ENV] = point
        try:
            save_checkpoint(root, 2, job.groups, **job.parts(), extra={"step": 2})
            stopped = False
        except InjectedFault:
            stopped = True
        finally:
            del os.environ[FAULT_ENV]
        partial = [root / name for name in _tmp_dirs(root)]
        results[point] = dict(
            stopped=stopped,
            complete=[c.step for c in manager.complete()],
            previous_intact=_digests(manager.latest().path) == before,
            partial_has_manifest=[(p / "manifest.json").is_file() for p in partial],
        )
    return results


def _failing(open_error: OSError | None = None, mkdir_error: OSError | None = None, match: str = ""):
    """Patch open()/Path.mkdir to raise for checkpoint paths containing `match` (forked writer
    processes inherit the patch)."""
    real_open, real_mkdir = builtins.open, pathlib.Path.mkdir

    def open_(file, *args, **kwargs):
        if open_error is not None and match in str(file):
            raise OSError(open_error.errno, open_error.strerror, str(file))
        return real_open(file, *args, **kwargs)

    def mkdir(self, *args, **kwargs):
        if mkdir_error is not None and match in str(self):
            raise OSError(mkdir_error.errno, mkdir_error.strerror, str(self))
        return real_mkdir(self, *args, **kwargs)

    builtins.open, pathlib.Path.mkdir = open_, mkdir
    return lambda: (setattr(builtins, "open", real_open), setattr(pathlib.Path, "mkdir", real_mkdir))


def _disk_errors(job: ToyJob, root: Path) -> dict:
    from megarl.workers.checkpoint import CheckpointError, save_checkpoint

    cases = {
        "ENOSPC in megatron's shard files": dict(
            open_error=OSError(errno.ENOSPC, "No space left on device"), match=".distcp"
        ),
        "EACCES on the RNG file": dict(open_error=OSError(errno.EACCES, "Permission denied"), match="rng/rank_"),
        "EROFS creating the dir": dict(
            mkdir_error=OSError(errno.EROFS, "Read-only file system"), match="step_00000003"
        ),
    }
    manager = CheckpointManager(root)
    results = {}
    for name, failure in cases.items():
        before = _digests(manager.latest().path)
        restore = _failing(**failure)
        try:
            save_checkpoint(root, 3, job.groups, **job.parts(), extra={"step": 3})
            error = None
        except CheckpointError as e:
            error = dict(message=str(e), cause=e.__cause__)
        finally:
            restore()
        results[name] = dict(
            error=error,
            latest=manager.latest().step,
            tmp_dirs=_tmp_dirs(root),
            previous_intact=_digests(manager.latest().path) == before,
        )
    # A real OS error: the checkpoint dir lies under a regular file.
    (root.parent / "a_file").write_text("")
    try:
        save_checkpoint(root.parent / "a_file" / "ckpt", 3, job.groups, **job.parts(), extra={})
        results["ENOTDIR"] = None
    except CheckpointError as e:
        results["ENOTDIR"] = str(e)
    return results


def _world(root: str, hf_assets: str) -> dict:
    from megarl.workers.checkpoint import export_hf, load_checkpoint, save_checkpoint

    root = Path(root)
    job = ToyJob(1, seed=3, use_distributed_optimizer=False)
    job.train_step()
    save_checkpoint(root, 1, job.groups, **job.parts(), extra={"step": 1})
    disk = _disk_errors(job, root)
    killed = _killed_saves(job, root)
    # The next save that completes clears every partial save, then rotation keeps the newest.
    job.train_step()
    second = save_checkpoint(root, 2, job.groups, **job.parts(), extra={"step": 2})
    after_save = dict(tmp_dirs=_tmp_dirs(root), complete=[c.step for c in CheckpointManager(root).complete()])
    deleted = [p.name for p in CheckpointManager(root, max_keep=1).rotate()]
    weights = job.local_weights()
    job.train_step()  # move away, then come back through the checkpoint
    extra = load_checkpoint(second, job.groups, **job.parts())
    reloaded = all((job.local_weights()[k] == v).all() for k, v in weights.items())
    exported = export_hf(job.ddp, root, job.groups, hf_assets_dir=hf_assets)
    embedding = job.ddp.module.embedding.word_embeddings.weight.detach()[: TINY_QWEN2["vocab_size"]].clone().numpy()
    return dict(
        disk=disk,
        killed=killed,
        after_save=after_save,
        deleted=deleted,
        extra=extra,
        reloaded=reloaded,
        remaining=sorted(p.name for p in root.iterdir()),
        exported=str(exported),
        embedding=embedding,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    hf_assets = tmp_path_factory.mktemp("hf_assets")
    (hf_assets / "config.json").write_text(json.dumps(TINY_QWEN2))
    root = tmp_path_factory.mktemp("faults") / "ckpt"
    return run_distributed(_world, 1, str(root), str(hf_assets))[0], root


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_killed_save_leaves_the_previous_checkpoint(world, point):
    got = world[0]["killed"][point]
    assert got["stopped"], "the save did not stop at the fault point"
    assert got["complete"] == [1]  # the partial step 2 is not a checkpoint ...
    assert got["previous_intact"]  # ... and step 1 is byte for byte what it was
    if point == "before_rename":
        # Even with its manifest written, a temp dir is never taken for a checkpoint.
        assert True in got["partial_has_manifest"]


@pytest.mark.parametrize(
    "case", ["ENOSPC in megatron's shard files", "EACCES on the RNG file", "EROFS creating the dir"]
)
def test_disk_error_is_one_clear_error(world, case):
    got = world[0]["disk"][case]
    assert got["error"] is not None, "the save did not report the failure"
    message = got["error"]["message"]
    code = case.split()[0]
    assert "step_00000003" in message and f"({code})" in message, message
    assert got["error"]["cause"] is None  # no chained traceback behind an OS failure
    assert got["latest"] == 1 and got["previous_intact"]
    assert got["tmp_dirs"] == []  # the partial dir is gone


def test_checkpoint_dir_under_a_file(world):
    message = world[0]["disk"]["ENOTDIR"]
    assert message is not None and "a_file/ckpt/step_00000003" in message and "(ENOTDIR)" in message


def test_next_save_cleans_partial_saves_and_rotation_keeps_newest(world):
    got, _root = world
    assert got["after_save"] == dict(tmp_dirs=[], complete=[1, 2])
    assert got["deleted"] == ["step_00000001"]
    assert got["reloaded"] and got["extra"] == {"step": 2}


def test_final_actor_exports_to_hf(world):
    from safetensors.numpy import load_file

    got, root = world
    assert got["exported"] == str(root / "hf")
    assert got["remaining"] == ["hf", "step_00000002"]  # the export is not taken for a checkpoint
    tensors = load_file(root / "hf" / "model.safetensors")
    assert (tensors["model.embed_tokens.weight"] == got["embedding"]).all()
    assert json.loads((root / "hf" / "config.json").read_text()) == TINY_QWEN2
