"""The driver's view of the checkpoints under `checkpoint.dir`: listing, `resume`, `max_keep` rotation.

Pure filesystem work, no torch and no processes; the directory format (names, manifest, commit) is
`megarl.workers.checkpoint_files`, the per-rank save and load `megarl.workers.checkpoint`.

    manager = CheckpointManager(cfg.checkpoint.dir, max_keep=cfg.checkpoint.max_keep)
    start = manager.resolve_resume(cfg.checkpoint.resume)     # an intact Checkpoint or None
    ...
    manager.rotate()                                          # after each completed save

A role in a worker group of its own (a critic whose layout differs from the actor's) saves its own
complete checkpoint, `part_dir(step_dir, role)`, before the actor's group commits `step_dir`: a
complete step dir implies its parts. Rotation removes a part with its step, and parts whose step
never completed.

Listing and rotation trust a checkpoint whose files have the sizes its manifest lists; a resume reads
every byte first and checks the SHA-256s (`verify_checksums`), so that a damaged checkpoint is named
before any rank loads it. `resume: auto` then falls back to the newest intact one, and says so.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megarl.workers.checkpoint_files import (
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    Manifest,
    describe_os_error,
    new_nonce,
    part_dir,
    read_manifest,
    step_dir_name,
    tmp_dir_for,
    verify_checksums,
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

    def __init__(self, root: str | Path, *, max_keep: int | None = None, parts: tuple[str, ...] = ()):
        """`parts`: the roles that save parts of each checkpoint from groups of their own."""
        if max_keep is not None and max_keep < 1:
            raise ValueError(f"checkpoint.max_keep={max_keep}: keep at least 1 checkpoint, or None to keep all")
        self.root = Path(root).expanduser()
        self.max_keep = max_keep
        self.parts = parts

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

    def resolve_resume(self, resume: str, *, report: Callable[[str], None] = print) -> Checkpoint | None:
        """What `checkpoint.resume` means now: auto -> the newest intact checkpoint under the root
        (None if there is none), disable -> None, anything else -> that checkpoint directory, which must
        be intact. `report`: where auto says which checkpoints it passed over, and why.

        Raises CheckpointError naming the path and the damage when the named checkpoint is not intact,
        or when auto finds checkpoints but none of them intact.
        """
        if resume == "disable":
            return None
        if resume == "auto":
            return self._newest_intact(report)
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
            return self._intact(path)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint.resume={resume!r}: {e}; choose another checkpoint or auto") from None

    def _newest_intact(self, report: Callable[[str], None]) -> Checkpoint | None:
        step_dirs = sorted(self.root.iterdir(), reverse=True) if self.root.is_dir() else []
        damaged = []
        for path in (p for p in step_dirs if p.is_dir() and STEP_DIR.match(p.name)):
            try:
                checkpoint = self._intact(path)
            except CheckpointError as e:
                report(f"checkpoint.resume=auto: passing over {path}: {e}")
                damaged.append(path.name)
                continue
            if damaged:
                report(f"checkpoint.resume=auto: resuming from {path}, the newest intact checkpoint")
            return checkpoint
        if damaged:
            raise CheckpointError(
                f"checkpoint.resume=auto: no checkpoint under {self.root} is intact ({', '.join(damaged)}); "
                "set checkpoint.resume=disable to start anew, or restore a checkpoint from a copy"
            )
        return None

    def _intact(self, path: Path) -> Checkpoint:
        """`path` as a Checkpoint, after checking every byte of it and of its parts."""
        manifest = read_manifest(path)
        verify_checksums(path, manifest)
        for role in self.parts:
            part = part_dir(path, role)
            verify_checksums(part, read_manifest(part))
        return Checkpoint(path, manifest)

    def rotate(self) -> list[Path]:
        """Delete the oldest complete checkpoints beyond `max_keep` (and the parts of no kept
        checkpoint); returns the deleted checkpoint dirs.

        Counts only complete checkpoints, so the newest complete one is never deleted (a save that
        did not finish does not count), and never touches anything that is not a complete checkpoint.
        Each victim is first renamed to a temp name (atomic), so a crash mid-delete cannot leave a
        half-deleted dir that still looks like a checkpoint.
        """
        complete = self.complete()
        victims = [] if self.max_keep is None else complete[: -self.max_keep]
        for checkpoint in victims:
            self._remove(checkpoint.path)
        kept = {c.path.name for c in complete[len(victims) :]}
        for role in self.parts:
            for part in CheckpointManager(self.root / role).complete():
                if part.path.name not in kept:
                    self._remove(part.path)
        return [c.path for c in victims]

    def _remove(self, path: Path) -> None:
        doomed = tmp_dir_for(path, new_nonce())
        try:
            path.rename(doomed)
            shutil.rmtree(doomed)
        except OSError as e:
            raise CheckpointError(
                f"removing old checkpoint {path} (checkpoint.max_keep={self.max_keep}) failed: {describe_os_error(e)}"
            ) from None
