"""Shared-memory transport: the rollout engine is on the sender's node (colocated, or another
process there). The sender copies each bucket once into memory the engine's workers can map
(`SharedBucket`), hands the engine the small picklable handles of the whole sync, and every worker
of the engine (TP 1 in-process, TP > 1 in vLLM's worker processes) reads the buckets in place: no
bytes travel over a socket or a collective.

    transport = SharedMemoryTransport(deliver=engine.load_shared_buckets)   # engine in this process
    transport = SharedMemoryTransport(deliver=lambda handles: ray.get(rollout.load_shared_buckets.remote(handles)))

CPU: each bucket is a file in /dev/shm (tmpfs, i.e. memory), mapped shared by the sender and the
workers (`torch.from_file(..., shared=True)`) and named by its path; the sender unlinks the files
when the engine has loaded them (the workers' mappings, if any remain, keep the pages until they go).
GPU: `cuda_ipc.CudaIpcTransport`, the same transport with CUDA IPC handles instead of files.

The handles of one sync go in one delivery because the engine loads a sync in one pass (a fused
layer's parts may lie in different buckets; see `vllm_engine`), so the sender holds the whole
sync's buckets in shared memory until the engine has loaded them: one copy of the model per node,
which all the engine's workers share (the broadcast transport instead holds about one bucket).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megarl.bridge.transports.base import Buckets, WeightTransport
from megarl.workers.rollout.weight_sync_protocol import BucketMetadata, SharedBucket

SHM_DIR = "/dev/shm"
"""Where the buckets' files live: tmpfs, so a file is memory that any process can map by path."""
FILE_PREFIX = "megarl-bucket-"
"""Name prefix of the buckets' files (to find leftovers of a killed sender)."""

Deliver = Callable[[Sequence[SharedBucket]], None]
"""Hands one sync's handles to the engine; returns once the engine has loaded them all."""


@dataclass(frozen=True)
class ShmBucket(SharedBucket):
    """A bucket in a file in shared memory: picklable, a few hundred bytes whatever its size."""

    metadata: BucketMetadata
    """The bucket's tensors (names, shapes, offsets)."""
    path: str
    """The file holding the flat buffer, `metadata.numel` elements of `metadata.dtype`."""

    def open(self, device: torch.device) -> torch.Tensor:
        """Map the file (no copy); a CPU buffer, whatever `device` (vLLM's loaders move tensors)."""
        return torch.from_file(self.path, shared=True, size=self.metadata.numel, dtype=self.metadata.dtype)


def share_in_file(flat: torch.Tensor, metadata: BucketMetadata, directory: str = SHM_DIR) -> ShmBucket:
    """Copy a flat buffer `[numel]` into a new file of `directory`; the caller unlinks `bucket.path`."""
    if not os.path.isdir(directory):
        raise RuntimeError(
            f"shared-memory weight sync: {directory} does not exist; it needs a Linux tmpfs there "
            f"(or use the broadcast transport)"
        )
    fd, path = tempfile.mkstemp(prefix=FILE_PREFIX, dir=directory)
    os.close(fd)
    bucket = ShmBucket(metadata, path)
    try:
        bucket.open(flat.device).copy_(flat)
    except BaseException:
        os.unlink(path)
        raise
    return bucket


class SharedMemoryTransport(WeightTransport):
    """Shares each bucket (`_share`), delivers the sync's handles in one call, then releases them
    (`_release`), also when the delivery fails."""

    def __init__(self, deliver: Deliver, directory: str = SHM_DIR):
        self.deliver = deliver
        self.directory = directory

    def send(self, buckets: Buckets) -> None:
        shared: list[SharedBucket] = []
        try:
            for flat, metadata in buckets:
                shared.append(self._share(flat, metadata))
                del flat  # the shared copy is what stays
            self.deliver(shared)
        finally:
            for bucket in shared:
                self._release(bucket)

    def _share(self, flat: torch.Tensor, metadata: BucketMetadata) -> SharedBucket:
        return share_in_file(flat.cpu(), metadata, self.directory)

    def _release(self, bucket: SharedBucket) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(bucket.path)
