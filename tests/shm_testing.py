"""A private /dev/shm for a command a test runs, so the test can tell exactly what that run left there.

The machine's /dev/shm is shared: other tests and users create and remove files there while a test
runs, and the names of what a run creates are random (Python's `psm_*` segments and `sem.mp-*`
semaphores) or hold ids the test never sees (vLLM's `vllm_dist_<uuid>-...`), so a before/after
comparison of the real directory cannot tell the run's files from anyone else's. Instead the command
runs in a mount namespace of its own (`unshare --mount`, private propagation: util-linux's default) in
which /dev/shm is a bind mount of an empty directory of the test's own inside the real /dev/shm: every
file any process of the run creates in /dev/shm (by path, `shm_open`, `sem_open`) lands in that
directory and nothing of anyone else's does. It is the same tmpfs, so the run sees the machine's real
shared-memory limits (Ray's object store sizes itself by them). The namespace ends with the run's last
process; the directory stays for the test to read, and `remove` deletes it.

`unshare --mount` needs CAP_SYS_ADMIN: the development and CI machines run the tests as root.

    shm = PrivateShm.make()
    subprocess.run(shm.wrap([megarl, "train", ...]))   # the run's process is megarl itself (exec)
    assert shm.leftovers() == []
    shm.remove()
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")
BIND = 'mount --bind "$0" /dev/shm && exec "$@"'
"""Run in the new namespace: the test's directory over /dev/shm, then the command itself in this process."""


@dataclass(frozen=True)
class PrivateShm:
    """A directory in the real /dev/shm that a wrapped command sees as its /dev/shm."""

    path: Path

    @classmethod
    def make(cls) -> PrivateShm:
        """A new empty one; skips the test where mount namespaces are refused (not root)."""
        path = Path(tempfile.mkdtemp(prefix="megarl-test-shm-", dir=SHM_DIR))
        probe = subprocess.run(
            ["unshare", "--mount", "sh", "-c", BIND, str(path), "true"], capture_output=True, text=True
        )
        if probe.returncode != 0:
            shutil.rmtree(path, ignore_errors=True)
            pytest.skip(f"a private /dev/shm needs `unshare --mount` (root): {probe.stderr.strip()}")
        return cls(path)

    def wrap(self, command: list[str]) -> list[str]:
        """`command` run with this directory as its /dev/shm; its process id is the command's."""
        return ["unshare", "--mount", "sh", "-c", BIND, str(self.path), *command]

    def leftovers(self) -> list[str]:
        """What the run left in its /dev/shm (sorted names, directories included)."""
        return sorted(p.name for p in self.path.iterdir())

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
