"""Checkpoint bookkeeping without processes: what counts as complete, `resume`, rotation, cleanup."""

import errno
import hashlib
import json

import pytest

from megarl.trainer.checkpoint_manager import CheckpointManager
from megarl.workers.checkpoint_files import (
    MANIFEST,
    CheckpointError,
    build_manifest,
    commit,
    describe_os_error,
    part_dir,
    read_manifest,
    remove_stale_tmp_dirs,
    step_dir_name,
    tmp_dir_for,
    verify_checksums,
)

LAYOUT = {"world_size": 2, "tp": 2, "pp": 1, "dp": 1, "ep": 1, "etp": 2}


def _save(root, step, payload=b"weights"):
    """What save_checkpoint does on disk, minus megatron: files into a temp dir, then commit."""
    step_dir = root / step_dir_name(step)
    tmp = tmp_dir_for(step_dir, "ab12cd34")
    (tmp / "actor" / "model").mkdir(parents=True)
    (tmp / "actor" / "model" / "__0_0.distcp").write_bytes(payload)
    (tmp / "extra.json").write_text(json.dumps({"step": step}))
    commit(tmp, step_dir, build_manifest(tmp, step=step, roles=["actor"], layout=LAYOUT))
    return step_dir


def test_step_dirs_sort_like_steps():
    assert step_dir_name(42) == "step_00000042"
    assert sorted(step_dir_name(s) for s in (100, 9, 10)) == [step_dir_name(s) for s in (9, 10, 100)]


def test_commit_writes_a_manifest_that_lists_every_file(tmp_path):
    step_dir = _save(tmp_path, 3)
    manifest = read_manifest(step_dir)
    assert manifest.step == 3 and manifest.roles == ["actor"] and manifest.layout == LAYOUT
    assert manifest.files == {"actor/model/__0_0.distcp": len(b"weights"), "extra.json": len('{"step": 3}')}
    assert manifest.sha256 == {
        "actor/model/__0_0.distcp": hashlib.sha256(b"weights").hexdigest(),
        "extra.json": hashlib.sha256(b'{"step": 3}').hexdigest(),
    }
    assert [p.name for p in tmp_path.iterdir()] == [step_dir.name]  # the temp dir became the step dir


def test_a_manifest_from_before_expert_parallelism_reads_as_ep_1_with_expert_tp_equal_to_tp(tmp_path):
    tmp = tmp_dir_for(tmp_path / step_dir_name(1), "ab12cd34")
    (tmp / "actor").mkdir(parents=True)
    dense = {"world_size": 4, "tp": 2, "pp": 1, "dp": 2}
    commit(tmp, tmp_path / step_dir_name(1), build_manifest(tmp, step=1, roles=["actor"], layout=dense))
    assert read_manifest(tmp_path / step_dir_name(1)).layout == dense | {"ep": 1, "etp": 2}


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: (d / MANIFEST).unlink(), "manifest.json is missing"),
        (lambda d: (d / MANIFEST).write_text("{not json"), "cannot be read"),
        (lambda d: (d / "extra.json").unlink(), "extra.json is listed in manifest.json but missing"),
        (lambda d: (d / "actor/model/__0_0.distcp").write_bytes(b"trunc"), "has 5 bytes, manifest.json lists 7"),
        (lambda d: d.rename(d.parent / step_dir_name(4)), "is for step 3"),
        (
            lambda d: _edit_manifest(d, format="megarl-checkpoint/1"),
            "checkpoints of format megarl-checkpoint/1 carry no checksums",
        ),
        (lambda d: _edit_manifest(d, sha256={}), "do not list the same files"),
    ],
    ids=["no-manifest", "corrupt-manifest", "missing-file", "wrong-size", "renamed", "old-format", "checksums-dropped"],
)
def test_damaged_checkpoints_are_not_complete(tmp_path, damage, reason):
    step_dir = _save(tmp_path, 3)
    damage(step_dir)
    (damaged,) = tmp_path.iterdir()
    with pytest.raises(CheckpointError, match=reason):
        read_manifest(damaged)
    assert CheckpointManager(tmp_path).complete() == []


def _edit_manifest(step_dir, **fields):
    manifest = json.loads((step_dir / MANIFEST).read_text())
    (step_dir / MANIFEST).write_text(json.dumps(manifest | fields))


def _flip_a_byte(step_dir):
    """Same-size damage, which sizes cannot see: a bit flipped in the middle of the weights."""
    shard = step_dir / "actor/model/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def test_checksums_find_same_size_damage_that_sizes_miss(tmp_path):
    step_dir = _save(tmp_path, 3)
    verify_checksums(step_dir, read_manifest(step_dir))  # intact
    _flip_a_byte(step_dir)
    manifest = read_manifest(step_dir)  # the sizes still agree
    with pytest.raises(
        CheckpointError,
        match=r"step_00000003 is damaged: actor/model/__0_0.distcp has SHA-256 \w+\.\.\., "
        r"manifest.json lists \w+",
    ):
        verify_checksums(step_dir, manifest)


@pytest.mark.parametrize(
    "damage",
    [_flip_a_byte, lambda d: (d / "actor/model/__0_0.distcp").write_bytes(b"trunc")],
    ids=["same-size", "truncated"],
)
def test_resume_auto_falls_back_to_the_newest_intact_checkpoint_and_says_so(tmp_path, damage):
    _save(tmp_path, 1)
    intact, newest = _save(tmp_path, 2), _save(tmp_path, 3)
    damage(newest)
    said = []
    assert CheckpointManager(tmp_path).resolve_resume("auto", report=said.append).path == intact
    assert len(said) == 2, said
    assert said[0].startswith(
        f"checkpoint.resume=auto: passing over {newest}: {newest} is damaged: actor/model/__0_0.distcp has "
    )
    assert said[1] == f"checkpoint.resume=auto: resuming from {intact}, the newest intact checkpoint"


def test_resume_auto_refuses_when_every_checkpoint_is_damaged(tmp_path):
    for step in (1, 2):
        _flip_a_byte(_save(tmp_path, step))
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint under .* is intact \(step_00000002, step_00000001\); "
        "set checkpoint.resume=disable to start anew",
    ):
        CheckpointManager(tmp_path).resolve_resume("auto", report=lambda line: None)


def test_resume_checks_the_parts_of_a_checkpoint_too(tmp_path):
    intact = _save(tmp_path, 1)
    _save(tmp_path / "critic", 1)
    _save(tmp_path / "critic", 2)
    _save(tmp_path, 2)
    _flip_a_byte(part_dir(tmp_path / step_dir_name(2), "critic"))
    said = []
    manager = CheckpointManager(tmp_path, parts=("critic",))
    assert manager.resolve_resume("auto", report=said.append).path == intact
    assert "critic/step_00000002 is damaged" in said[0]
    with pytest.raises(
        CheckpointError, match=r"checkpoint.resume='.*step_00000002': .*critic/step_00000002 is damaged"
    ):
        manager.resolve_resume(str(tmp_path / step_dir_name(2)))


def test_latest_skips_temp_and_incomplete_dirs(tmp_path):
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    (tmp_path / step_dir_name(30)).mkdir()  # no manifest: a copy that stopped half way
    (tmp_path / "step_00000040.tmp-0badf00d" / "actor").mkdir(parents=True)
    manager = CheckpointManager(tmp_path)
    assert [c.step for c in manager.complete()] == [10, 20]
    assert manager.latest().path == tmp_path / step_dir_name(20)
    assert CheckpointManager(tmp_path / "nothing-here").latest() is None


def test_resume_auto_disable_and_path(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.resolve_resume("auto") is None  # a first run
    older, newer = _save(tmp_path, 1), _save(tmp_path, 2)
    assert manager.resolve_resume("auto").path == newer
    assert manager.resolve_resume("disable") is None
    assert manager.resolve_resume(str(older)).step == 1


def test_resume_path_errors_name_the_path_and_the_reason(tmp_path):
    manager = CheckpointManager(tmp_path)
    step_dir = _save(tmp_path, 5)
    with pytest.raises(CheckpointError, match=r"checkpoint.resume='.*step_00000099'.*is not a directory"):
        manager.resolve_resume(str(tmp_path / step_dir_name(99)))
    with pytest.raises(CheckpointError, match="checkpoint root, not a checkpoint"):
        manager.resolve_resume(str(tmp_path))
    (step_dir / "extra.json").unlink()
    with pytest.raises(CheckpointError, match=r"step_00000005.*incomplete: extra.json"):
        manager.resolve_resume(str(step_dir))
    _save(tmp_path, 5)
    _flip_a_byte(step_dir)
    with pytest.raises(CheckpointError, match=r"step_00000005.*damaged: actor/model/__0_0.distcp has SHA-256"):
        manager.resolve_resume(str(step_dir))  # a checkpoint named by the user: no fallback


def test_rotation_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    deleted = CheckpointManager(tmp_path, max_keep=2).rotate()
    assert deleted == [tmp_path / step_dir_name(1), tmp_path / step_dir_name(2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(3), step_dir_name(4)]
    assert CheckpointManager(tmp_path).rotate() == []  # max_keep=None keeps all


def test_rotation_removes_the_parts_of_removed_and_of_never_completed_checkpoints(tmp_path):
    # A critic in a group of its own saves its part before the actor's group commits the step.
    for step in (1, 2, 3):
        _save(tmp_path / "critic", step)
        _save(tmp_path, step)
    _save(tmp_path / "critic", 4)  # the actor's step 4 never completed
    CheckpointManager(tmp_path, max_keep=2, parts=("critic",)).rotate()
    kept = CheckpointManager(tmp_path).complete()
    assert [c.step for c in kept] == [2, 3]
    assert [c.path for c in CheckpointManager(tmp_path / "critic").complete()] == [
        part_dir(c.path, "critic") for c in kept
    ]


def test_rotation_never_deletes_the_only_complete_checkpoint(tmp_path):
    only = _save(tmp_path, 1)
    # A newer save that never completed (crash before the rename, or a half-copied dir) does not count.
    (tmp_path / "step_00000002.tmp-12345678").mkdir()
    (tmp_path / step_dir_name(3)).mkdir()
    assert CheckpointManager(tmp_path, max_keep=1).rotate() == []
    assert read_manifest(only).step == 1
    # Rotation deletes complete checkpoints only: it leaves other dirs to the save's cleanup.
    assert (tmp_path / step_dir_name(3)).is_dir()


def test_max_keep_must_keep_one(tmp_path):
    with pytest.raises(ValueError, match="checkpoint.max_keep=0"):
        CheckpointManager(tmp_path, max_keep=0)


def test_stale_temp_dirs_are_the_only_thing_cleaned(tmp_path):
    keep = [_save(tmp_path, 1), tmp_path / "hf", tmp_path / "notes.tmp-abc"]
    keep[1].mkdir()
    keep[2].write_text("a user's file")
    stale = [tmp_path / "step_00000002.tmp-deadbeef", tmp_path / "step_00000003.tmp-0123abcd"]
    for path in stale:
        (path / "actor").mkdir(parents=True)
    assert remove_stale_tmp_dirs(tmp_path) == stale
    assert sorted(tmp_path.iterdir()) == sorted(keep)


def test_commit_replaces_a_checkpoint_of_the_same_step(tmp_path):
    _save(tmp_path, 7, payload=b"first run")
    step_dir = _save(tmp_path, 7, payload=b"rerun")
    assert (step_dir / "actor/model/__0_0.distcp").read_bytes() == b"rerun"
    assert [p.name for p in tmp_path.iterdir()] == [step_dir.name]


def test_os_errors_read_as_one_line():
    error = OSError(errno.ENOSPC, "No space left on device", "/ckpt/step_00000001.tmp-ab/actor/x.distcp")
    assert describe_os_error(error) == "No space left on device (ENOSPC) at /ckpt/step_00000001.tmp-ab/actor/x.distcp"
