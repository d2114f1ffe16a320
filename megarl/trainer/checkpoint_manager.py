"""The driver's view of the checkpoints under `checkpoint.dir`: listing, `resume`, `max_keep` rotation.

Pure filesystem work, no torch and no processes; the directory format (names, manifest, commit) is
`megarl.workers.checkpoint_files`, the per-rank save and load `megarl.workers.checkpoint`.

    manager = CheckpointManager(cfg.checkpoint.dir, max_keep=cfg.checkpoint.max_keep)
    start = manager.resolve_resume(cfg.checkpoint.resume)     # a Checkpoint or None
    ...
    manager.rotate()                                          # after each completed save
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from megarl.workers.checkpoint_files import (
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    Manifest,
    describe_os_error,
    new_nonce,
    read_manifest,
    step_dir_name,
    tmp_dir_for,
)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its directory and verified manifest."""

    path: Path
    """The `step_<N>` directory."""
    manifest: Manifest
    """Its verified manifest."""

    @property
    def step(self) -> int:
        return self.manifest.step


class CheckpointManager:
    """The checkpoints under one root (`checkpoint.dir`): listing, `resume`, `max_keep` rotation."""

    def __init__(self, root: str | Path, *, max_keep: int | None = None):
        if max_keep is not None and max_keep < 1:
            raise ValueError(f"checkpoint.max_keep={max_keep}: keep at least 1 checkpoint, or None to keep all")
        self.root = Path(root).expanduser()
        self.max_keep = max_keep

    def step_dir(self, step: int) -> Path:
        """Where the checkpoint of `step` lives once complete."""
        return self.root / step_dir_name(step)

    def complete(self) -> list[Checkpoint]:
        """Every complete checkpoint under the root, oldest step first. Temp dirs, dirs without a
        valid manifest and files that do not verify are skipped."""
        found = []
        for path in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if path.is_dir() and STEP_DIR.match(path.name):
                try:
                    found.append(Checkpoint(path, read_manifest(path)))
                except CheckpointError:
                    continue
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        """The complete checkpoint of the highest step, or None."""
        complete = self.complete()
        return complete[-1] if complete else None

    def resolve_resume(self, resume: str) -> Checkpoint | None:
        """What `checkpoint.resume` means now: auto -> the latest complete checkpoint under the root
        (None if there is none), disable -> None, anything else -> that checkpoint directory.

        Raises CheckpointError naming the path when it is missing or incomplete.
        """
        if resume == "disable":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume).expanduser()
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint.resume={resume!r}: {path} is not a directory; use auto, disable, or a "
                f"complete checkpoint directory such as {self.step_dir(0)}"
            )
        if not (path / MANIFEST).exists() and CheckpointManager(path).complete():
            raise CheckpointError(
                f"checkpoint.resume={resume!r} is a checkpoint root, not a checkpoint: point it at one of its "
                f"step_<N> directories, or set checkpoint.dir={resume!r} and checkpoint.resume=auto"
            )
        try:
            return Checkpoint(path, read_manifest(path))
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint.resume={resume!r}: {e}; choose another checkpoint or auto") from None

    def rotate(self) -> list[Path]:
        """Delete the oldest complete checkpoints beyond `max_keep`; returns the deleted dirs.

        Counts only complete checkpoints, so the newest complete one is never deleted (a save that
        did not finish does not count), and never touches anything that is not a complete checkpoint.
        Each victim is first renamed to a temp name (atomic), so a crash mid-delete cannot leave a
        half-deleted dir that still looks like a checkpoint.
        """
        if self.max_keep is None:
            return []
        victims = self.complete()[: -self.max_keep]
        for checkpoint in victims:
            doomed = tmp_dir_for(checkpoint.path, new_nonce())
            try:
                checkpoint.path.rename(doomed)
                shutil.rmtree(doomed)
            except OSError as e:
                raise CheckpointError(
                    f"removing old checkpoint {checkpoint.path} (checkpoint.max_keep={self.max_keep}) failed: "
                    f"{describe_os_error(e)}"
                ) from None
        return [c.path for c in victims]
