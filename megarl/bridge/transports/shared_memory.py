"""Shared-memory transport: the rollout engine is on the sender's node (colocated, or another
process there). The sender streams one sync's buckets through two slots of memory the engine's
workers map (`megarl.bridge.shared_ring`): bucket i is copied once into slot i % 2, every
worker of the engine (TP 1 in-process, TP > 1 in vLLM's worker processes) reads it in place within
its one load of the sync, and the sender overwrites the slot with bucket i + 2 once all of them have
released it. No bytes travel over a socket or a collective, and a sync holds two buckets in shared
memory, not the model (`peak_shared_bytes`).

    transport = SharedMemoryTransport(readers=rollout_tp)        # on the sender, once
    ring = transport.begin()                                   # each sync: a new ring ...
    engine.receive(SharedRings({r: ring for r in range(rollout_tp)}))   # ... the engine starts loading,
    transport.send(buckets)                                    # then the sender streams the buckets

`begin` opens the sync's slots and names its ring (a small picklable handle that the driver passes
to the engine workers that read it, `megarl.bridge.ring_routes`: `RolloutWorker.start_receive`); `send` streams the buckets and
returns once every worker has loaded the sync.

CPU: each slot is a file in /dev/shm (tmpfs, i.e. memory), mapped shared by the sender and the
workers (`torch.from_file(..., shared=True)`) and named by its path; a file grows to the largest
bucket written into it, and the sender deletes both when the sync ends, also when it fails.
GPU: `cuda_ipc.CudaIpcTransport`, the same ring with CUDA IPC handles instead of files.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.bridge.protocol import BucketMetadata, SharedBucket
from megarl.bridge.shared_ring import SLOTS, RingSender, SharedRing, process_alive
from megarl.bridge.transports.base import Buckets, WeightTransport

SHM_DIR = "/dev/shm"
"""Where the slots' files live: tmpfs, so a file is memory that any process can map by path."""
FILE_PREFIX = "megarl-bucket-"
"""Name prefix of the slots' files: `megarl-bucket-<pid of the sender>-<random>`."""


def new_slot_file(directory: str) -> str:
    """A new empty file in `directory` named for this process, first removing the files of senders
    that died without removing theirs (a killed trainer rank): a dead pid's files are nobody's."""
    remove_slot_files(lambda pid: not process_alive(pid), directory)
    fd, path = tempfile.mkstemp(prefix=f"{FILE_PREFIX}{os.getpid()}-", dir=directory)
    os.close(fd)
    return path


def remove_slot_files(owned_by: Callable[[int], bool], directory: str = SHM_DIR) -> None:
    """Remove the slot files in `directory` whose sender's pid `owned_by` picks (dead senders, or the
    trainer ranks a run just killed: `Roles.shutdown`)."""
    for path in glob.glob(os.path.join(directory, f"{FILE_PREFIX}*-*")):
        owner = os.path.basename(path)[len(FILE_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and owned_by(int(owner)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@dataclass(frozen=True)
class ShmBucket(SharedBucket):
    """A bucket in a file in shared memory: picklable, a few hundred bytes whatever its size."""

    metadata: BucketMetadata
    """The bucket's tensors (names, shapes, offsets)."""
    path: str
    """The file holding the flat buffer in its first `metadata.numel` elements of `metadata.dtype`."""

    def open(self, device: torch.device) -> torch.Tensor:
        """Map the file (no copy); a CPU buffer, whatever `device` (vLLM's loaders move tensors)."""
        return torch.from_file(self.path, shared=True, size=self.metadata.numel, dtype=self.metadata.dtype)


class SharedMemoryTransport(WeightTransport):
    """Streams each sync through `SLOTS` shared slots into the engines started on its `begin()`
    ring; `readers`: their workers (engines × TP), each of which reads every bucket."""

    def __init__(self, readers: int, directory: str = SHM_DIR, timeout_s: float = 600.0):
        self.readers = readers
        self.directory = directory
        self.timeout_s = timeout_s
        self.peak_shared_bytes = 0
        """Most bytes the slots held at once during the last `send`."""
        self.largest_bucket_bytes = 0
        """The largest bucket of the last `send`: `peak_shared_bytes` stays within `SLOTS` of it."""
        self.slot_paths: list[str] = []
        """The slots' files during a `send`."""
        self._ring: RingSender | None = None
        """The side channel to the engines' workers, made by the first `begin`."""
        self._begun = False

    def begin(self) -> SharedRing:
        """Open the next sync's slots; its ring, with which every reading engine must start its
        load (`RolloutEngine.receive(SharedRings(...))`) before `send`."""
        self._close_slots()  # a sync begun but never sent
        self._open_slots()
        if self._ring is None:
            self._ring = RingSender.listen(self.readers, self.timeout_s)
        self._begun = True
        return self._ring.begin()

    def send(self, buckets: Buckets) -> None:
        if not self._begun:
            raise RuntimeError(
                "SharedMemoryTransport.send without begin(): start the engines' load with the ring that "
                "begin() returns, then send"
            )
        self._begun = False
        self.peak_shared_bytes = self.largest_bucket_bytes = 0
        ring = self._ring
        try:
            try:
                for index, (flat, metadata) in enumerate(buckets):
                    if index >= SLOTS:
                        ring.wait_released(index - SLOTS)
                    ring.publish(self._share(index % SLOTS, flat, metadata))
                    self.largest_bucket_bytes = max(self.largest_bucket_bytes, flat.nbytes)
                    self.peak_shared_bytes = max(self.peak_shared_bytes, self._shared_bytes())
                    del flat  # the slot's copy is what stays
                ring.finish()
            except BaseException as error:
                ring.abort(f"the sender failed: {error!r}")
                raise
        finally:
            self._close_slots()

    def _open_slots(self) -> None:
        if not os.path.isdir(self.directory):
            raise RuntimeError(
                f"shared-memory weight sync: {self.directory} does not exist; it needs a Linux tmpfs there "
                f"(or set rollout.sync.transport: collective)"
            )
        for _ in range(SLOTS):
            self.slot_paths.append(new_slot_file(self.directory))

    def _share(self, slot: int, flat: torch.Tensor, metadata: BucketMetadata) -> SharedBucket:
        """Copy a flat buffer `[numel]` into `slot` (its file grows to fit); its handle."""
        bucket = ShmBucket(metadata, self.slot_paths[slot])
        bucket.open(flat.device).copy_(flat)
        return bucket

    def _shared_bytes(self) -> int:
        return sum(os.stat(path).st_size for path in self.slot_paths)

    def _close_slots(self) -> None:
        for path in self.slot_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.slot_paths = []
