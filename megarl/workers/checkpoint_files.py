"""A training checkpoint's directory on disk: names, the manifest that marks one complete, the commit.

Pure filesystem work, no torch and no processes: rank 0 of `megarl.workers.checkpoint.save_checkpoint`
commits a save with it, and the driver's `megarl.trainer.checkpoint_manager` finds and rotates
checkpoints with it.

    <checkpoint.dir>/
      step_00000040/                 complete: its manifest.json verifies
      step_00000050.tmp-1f3a9c2e/    a save in progress, or a crashed one: never read, removed by the next save
      hf/                            the final actor as an HF checkpoint (`checkpoint.export_hf`)

A checkpoint is complete when `manifest.json` parses, names its own step, and every file it lists
exists with the listed size (`read_manifest`, cheap: used to list and rotate). It is intact when,
besides, every file's SHA-256 is the one the manifest lists (`verify_checksums`, reads every byte:
done before a resume loads it). The manifest is written last, inside the temp dir, and the temp dir
is renamed to `step_<N>` after it (rename is atomic on POSIX), so a crash at any point leaves either
the old set of complete checkpoints or the old set plus the new one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from megarl.versions import MEGARL

MANIFEST = "manifest.json"
EXTRA_FILE = "extra.json"
"""The driver's `extra` of a checkpoint (JSON): data position, KL coefficient, record, stream, identity."""
FORMAT = "megarl-checkpoint/2"
"""/2 added each file's SHA-256 (`Manifest.sha256`)."""
STEP_DIR = re.compile(r"^step_(\d{8,})$")
"""The name of a complete checkpoint's dir; group 1 is the step."""
_TMP_DIR = re.compile(r"^step_\d{8,}\.tmp-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or read; the message names the directory and the reason."""


def step_dir_name(step: int) -> str:
    """`step_00000042`: zero-padded so that names sort like steps."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:08d}"


def part_dir(step_dir: Path, role: str) -> Path:
    """`<root>/<role>/step_<N>`: the checkpoint of `role`'s own group that belongs to `<root>/step_<N>`."""
    return step_dir.parent / role / step_dir.name


def tmp_dir_for(step_dir: Path, nonce: str) -> Path:
    """The sibling temp dir a save of `step_dir` writes into before the rename."""
    return step_dir.parent / f"{step_dir.name}.tmp-{nonce}"


def new_nonce() -> str:
    """A random hex suffix for temp dir names."""
    return uuid.uuid4().hex[:8]


@dataclass(frozen=True)
class Manifest:
    """Contents of `manifest.json`, written last into a checkpoint."""

    format: str
    """Always `FORMAT`; other values are rejected."""
    step: int
    """The training step the checkpoint was taken after."""
    roles: list[str]
    """Models saved, e.g. ["actor", "critic"]: each has `<role>/model/` (and `<role>/optimizer/`)."""
    files: dict[str, int]
    """Every file of the checkpoint except the manifest: POSIX path relative to the step dir -> bytes."""
    sha256: dict[str, str]
    """The same files -> their SHA-256 (hex), taken after every rank wrote, before the manifest."""
    layout: dict[str, int]
    """Process layout it was saved from: world_size, tp, pp, dp, ep (expert parallel), etp (expert TP).
    Manifests written before expert parallelism have no ep / etp: read as ep 1, etp = tp."""
    megarl_version: str
    """`megarl.__version__` of the writer (`megarl.versions.MEGARL`)."""


def checkpoint_files(ckpt_dir: Path) -> list[str]:
    """Every file under `ckpt_dir` but the manifest, as sorted POSIX paths relative to it."""
    return [
        path.relative_to(ckpt_dir).as_posix()
        for path in sorted(ckpt_dir.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    ]


def file_digests(ckpt_dir: Path, names: list[str]) -> dict[str, str]:
    """SHA-256 (hex) of each of `names` (relative to `ckpt_dir`), read by a few threads: hashlib
    releases the GIL on large buffers, so the files are hashed in parallel at disk speed."""

    def digest(name: str) -> str:
        with open(ckpt_dir / name, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:
        return dict(zip(names, pool.map(digest, names)))


def build_manifest(
    ckpt_dir: Path, *, step: int, roles: list[str], layout: dict[str, int], digests: Mapping[str, str] | None = None
) -> Manifest:
    """A manifest listing every file now under `ckpt_dir` with its size and SHA-256. `digests`: the
    SHA-256s already taken (a save's ranks hash their share of the files in parallel); the files it
    lacks are hashed here."""
    names = checkpoint_files(ckpt_dir)
    known = dict(digests or {})
    sha256 = known | file_digests(ckpt_dir, [name for name in names if name not in known])
    return Manifest(
        format=FORMAT,
        step=step,
        roles=list(roles),
        files={name: (ckpt_dir / name).stat().st_size for name in names},
        sha256={name: sha256[name] for name in names},
        layout=dict(layout),
        megarl_version=MEGARL,
    )


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` to a new file and fsync it, so a completed save survives a power cut."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp_dir: Path, step_dir: Path, manifest: Manifest) -> None:
    """Write the manifest into `tmp_dir` and rename it to `step_dir` (rank 0, after every rank wrote).

    A complete checkpoint already at `step_dir` (a rerun from an earlier step) is renamed aside to a
    temp name first and removed after; a crash in between leaves it to the next save's cleanup.
    """
    write_durably(tmp_dir / MANIFEST, (json.dumps(asdict(manifest), indent=1) + "\n").encode())
    fault_point("before_rename")
    replaced = tmp_dir_for(step_dir, new_nonce()) if step_dir.exists() else None
    if replaced is not None:
        step_dir.rename(replaced)
    tmp_dir.rename(step_dir)
    _fsync_dir(step_dir.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def remove_stale_tmp_dirs(root: Path) -> list[Path]:
    """Delete the temp dirs of earlier saves that did not finish (only names like `step_<N>.tmp-<hex>`)."""
    stale = sorted(p for p in root.iterdir() if p.is_dir() and _TMP_DIR.match(p.name)) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path)
    return stale


def read_manifest(ckpt_dir: str | Path) -> Manifest:
    """Read and verify a checkpoint's manifest: it parses, names this dir's step, and every listed
    file exists with the listed size. Raises CheckpointError naming the dir and what is wrong."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST
    try:
        fields = json.loads(path.read_text())
        if isinstance(fields, dict) and fields.get("format") not in (None, FORMAT):
            raise CheckpointError(
                f"{path}: format {fields['format']!r}, this megarl reads {FORMAT!r} (checkpoints of format "
                "megarl-checkpoint/1 carry no checksums): resume it with the megarl that wrote it, or start anew"
            )
        manifest = Manifest(**fields)
        manifest.layout.setdefault("ep", 1)
        manifest.layout.setdefault("etp", manifest.layout.get("tp"))
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir} is not a complete megarl checkpoint: {MANIFEST} is missing") from None
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be read as a megarl checkpoint manifest: {e}") from None
    if set(manifest.sha256) != set(manifest.files):
        raise CheckpointError(f"{path} is damaged: its files and their checksums do not list the same files")
    name = STEP_DIR.match(ckpt_dir.name)
    if name and int(name.group(1)) != manifest.step:
        raise CheckpointError(f"{path} is for step {manifest.step}, but the directory is named {ckpt_dir.name}")
    for rel, size in manifest.files.items():
        file = ckpt_dir / rel
        if not file.is_file():
            raise CheckpointError(f"{ckpt_dir} is incomplete: {rel} is listed in {MANIFEST} but missing")
        if file.stat().st_size != size:
            raise CheckpointError(
                f"{ckpt_dir} is damaged: {rel} has {file.stat().st_size} bytes, {MANIFEST} lists {size}"
            )
    return manifest


def verify_checksums(ckpt_dir: str | Path, manifest: Manifest) -> None:
    """Check that every file of a complete checkpoint (`read_manifest`) has the SHA-256 its manifest
    lists: a same-size corruption (a flipped bit, a block of zeros) is found here, before any rank
    loads it. Raises CheckpointError naming the dir and the first file that differs."""
    ckpt_dir = Path(ckpt_dir)
    try:
        found = file_digests(ckpt_dir, sorted(manifest.sha256))
    except OSError as e:
        raise CheckpointError(f"{ckpt_dir} cannot be read: {describe_os_error(e)}") from None
    for name, expected in sorted(manifest.sha256.items()):
        if found[name] != expected:
            raise CheckpointError(
                f"{ckpt_dir} is damaged: {name} has SHA-256 {found[name][:12]}..., {MANIFEST} lists {expected[:12]}..."
            )


def describe_os_error(error: OSError) -> str:
    """`No space left on device (ENOSPC) at /ckpt/step_00000010.tmp-ab12/actor/model/x.distcp`."""
    code = os.strerror(error.errno) if error.errno else str(error)
    name = f" ({_errno_name(error.errno)})" if error.errno else ""
    where = f" at {error.filename}" if error.filename else ""
    return f"{code}{name}{where}"


def _errno_name(number: int) -> str:
    return errno.errorcode.get(number, str(number))


def _fsync_dir(path: Path) -> None:
    """Persist a rename: fsync the directory that holds the entry."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


FAULT_ENV = "MEGARL_CHECKPOINT_FAULT"
"""Test hook: set to one of `FAULT_POINTS` to make a save stop dead at that point (`InjectedFault`)."""
FAULT_POINTS = ("after_model", "after_optimizer", "before_manifest", "before_rename")
"""after_model: the first role's model files written on every rank; after_optimizer: its optimizer
files too; before_manifest: every file written, the manifest is next; before_rename: the manifest
is written inside the temp dir, the rename is next."""


class InjectedFault(BaseException):
    """Raised at the fault point named by `FAULT_ENV`. A BaseException, so nothing in the save catches
    it and no cleanup runs: the disk is left as a process killed at that point leaves it."""


def fault_point(name: str) -> None:
    """Stop the save here when the `FAULT_ENV` test hook names this point."""
    if os.environ.get(FAULT_ENV) == name:
        raise InjectedFault(name)
