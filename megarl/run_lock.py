"""One run per directory: `megarl train` and `megarl sft` lock the directories they write for the whole run.

Two runs writing one run directory destroy each other's record (one resumes from the other's mid-run
checkpoint, its metrics replace the other's). The lock is `flock` on a lock file, so the OS drops it when
its holder dies, however it dies; the file records the holder (pid, host, start time, command) for the
message that refuses a second run. A lock file whose holder died is stale: taken over, and named.

    with DirectoryLocks.acquire([("trainer.output_dir", run_dir, run_dir / LOCK_NAME)], command, "megarl train"):
        ...  # DirectoryBusy (before anything starts) names the directory, the holder and the fix

The lock file is removed when the run ends, with the directories the lock made that stayed empty (a run
refused at start-up leaves nothing behind). A waiter that opened the file before its removal notices the
file it locked is no longer the one at the path (`_lock_file`) and opens the new one.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".megarl.lock"
"""The lock file inside a directory that persists between runs (a run directory, a checkpoint root)."""

RECORD_BYTES = 65536
"""The most of a lock file read as its holder's record (a command line is far shorter)."""


class DirectoryBusy(Exception):
    """Another live run holds the lock of a directory this run would write."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a lock: what the lock file records."""

    pid: int
    host: str
    started: str
    """Local time the run took the lock, `YYYY-MM-DD HH:MM:SS`."""
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started} (`{self.command}`)"

    @classmethod
    def read(cls, fd: int) -> Holder | None:
        """The record in the open lock file, or None (empty, or written by no megarl run: e.g. cut by a crash)."""
        try:
            record = json.loads(os.pread(fd, RECORD_BYTES, 0))
            return cls(int(record["pid"]), str(record["host"]), str(record["started"]), str(record["command"]))
        except (ValueError, TypeError, KeyError):
            return None


class DirectoryLocks:
    """The held locks of one run; a context manager that releases them."""

    def __init__(self):
        self._held: list[tuple[Path, int]] = []
        self._made: list[Path] = []

    @classmethod
    def acquire(cls, locks: Sequence[tuple[str, Path, Path]], command: str, program: str) -> DirectoryLocks:
        """Lock each `(setting, directory, its lock file)` (the file's directory made if missing) for `command`, or raise
        `DirectoryBusy` naming the directory, the setting that chose it, the holder and the fix, holding
        nothing. A stale lock taken over is named on stderr, prefixed by `program`."""
        self = cls()
        me = Holder(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S"), command)
        seen: set[Path] = set()
        stale: dict[Holder, list[str]] = {}
        try:
            for setting, directory, path in locks:
                path = Path(path).absolute()
                if path in seen:
                    continue
                seen.add(path)
                self._made += _make_dirs(path.parent)
                fd = _lock_file(path, f"{Path(directory).absolute()} ({setting})", setting)
                self._held.append((path, fd))
                holder = Holder.read(fd)
                if holder is not None:
                    stale.setdefault(holder, []).append(str(Path(directory).absolute()))
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(me.__dict__).encode(), 0)
        except BaseException:
            self.release()
            raise
        for holder, directories in stale.items():  # one line per dead run, however many of its locks
            print(
                f"{program}: {' and '.join(directories)} {'were' if len(directories) > 1 else 'was'} locked by a run "
                f"that is no longer running ({holder}); taking {'their locks' if len(directories) > 1 else 'its lock'} "
                "over",
                file=sys.stderr,
            )
        return self

    def release(self) -> None:
        """Remove the lock files (while locked: see the module docstring), then the directories this run
        made for them that are still empty."""
        for path, fd in reversed(self._held):
            path.unlink(missing_ok=True)
            os.close(fd)
        self._held = []
        for directory in reversed(self._made):
            try:
                directory.rmdir()
            except OSError:
                pass  # the run wrote something there: it stays
        self._made = []

    def __enter__(self) -> DirectoryLocks:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _make_dirs(directory: Path) -> list[Path]:
    """mkdir -p `directory`; the directories it made, outermost first."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir(exist_ok=True)
    return list(reversed(missing))


def _lock_file(path: Path, what: str, setting: str) -> int:
    """An fd of `path` holding its exclusive flock, or `DirectoryBusy` naming `what` it locks."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Holder.read(fd)
            os.close(fd)
            raise DirectoryBusy(
                f"{what} is in use by another run: "
                f"{holder or 'a run whose record is not readable yet'}; fix: give this run another {setting}"
                f"{' or trainer.experiment_name' if setting == 'trainer.output_dir' else ''}, or stop that run"
                f"{f' (kill {holder.pid} on {holder.host})' if holder else ''}"
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder ended and removed the file between our open and our lock: lock the new one
