"""A newest checkpoint damaged on disk without changing its size (a flipped bit: what a size check
cannot see) is found by its SHA-256 before any rank loads it; `resume: auto` says so and falls back to
the newest intact checkpoint, from which the run continues exactly (issue 18 item 3)."""

import pytest

from megarl import Trainer
from megarl.trainer.checkpoint_manager import CheckpointManager
from megarl.workers.checkpoint_files import read_manifest, verify_checksums

from .conftest import QUICKSTART, overrides, read_metrics

EXACT = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy")


def _flip_a_bit_in_the_largest_file(step_dir):
    largest = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x01
    largest.write_bytes(bytes(data))
    return largest


def test_resume_auto_passes_over_a_same_size_damaged_checkpoint_saying_so(assets, tmp_path, capsys):
    args = overrides(assets, tmp_path, **{"trainer.total_steps": 4, "checkpoint.save_freq": 2,
                                          "checkpoint.export_hf": "false"})
    first = Trainer.from_config(QUICKSTART, args)
    first.fit()
    before = read_metrics(first.run_dir / "metrics.jsonl")
    manager = CheckpointManager(tmp_path / "checkpoints")
    intact, newest = [c.path for c in manager.complete()]
    damaged = _flip_a_bit_in_the_largest_file(newest)
    assert manager.latest().path == newest  # the sizes still agree: listing alone cannot tell
    capsys.readouterr()

    Trainer.from_config(QUICKSTART, args).fit()
    out = capsys.readouterr().out
    relative = damaged.relative_to(newest).as_posix()
    assert f"checkpoint.resume=auto: passing over {newest}: {newest} is damaged: {relative} has SHA-256 " in out
    assert f"checkpoint.resume=auto: resuming from {intact}, the newest intact checkpoint" in out
    after = read_metrics(first.run_dir / "metrics.jsonl")
    assert [m["step"] for m in after] == [1, 2, 3, 4]
    for ours, theirs in zip(after[2:], before[2:]):  # steps 3 and 4, trained again from step 2's checkpoint
        for key in EXACT:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (ours["step"], key)
    verify_checksums(newest, read_manifest(newest))  # the rerun's save replaced the damaged one
