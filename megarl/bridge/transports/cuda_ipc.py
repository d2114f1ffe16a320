"""CUDA IPC transport: the GPU adapter of `shared_memory.SharedMemoryTransport` for colocated
GPUs. The same two-slot ring (`megarl.bridge.shared_ring`), with a slot being a GPU buffer
of the sender shared by CUDA IPC handle (`reduce_tensor`) instead of a file: the sender moves
bucket i to its GPU and keeps that buffer as slot i % 2 until the workers release it, and the
rollout workers on the same GPU open the handle and load from the sender's memory. GPU only:
constructing it without CUDA raises. (Not exercised on this project's CPU machines.)

    transport = CudaIpcTransport(readers=rollout_tp)       # then as SharedMemoryTransport: begin, send

A handle names the device by the *sender's* index, which differs in a worker that sees other
`CUDA_VISIBLE_DEVICES`: the worker substitutes its own index for the same physical GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from megarl.bridge.transports.shared_memory import SharedMemoryTransport
from megarl.parallel.device import uses_cuda
from megarl.bridge.shared_ring import SLOTS
from megarl.bridge.protocol import BucketMetadata, SharedBucket

_DEVICE_ARG = 6
"""Position of the storage device in `rebuild_cuda_tensor`'s arguments (torch 2.x)."""


@dataclass(frozen=True)
class IpcBucket(SharedBucket):
    """One bucket shared by CUDA IPC handle: picklable, a few hundred bytes whatever its size."""

    metadata: BucketMetadata
    """The bucket's tensors (names, shapes, offsets)."""
    rebuild_args: tuple
    """`rebuild_cuda_tensor` arguments of the flat buffer (from `reduce_tensor`), handle included."""

    def open(self, device: torch.device) -> torch.Tensor:
        """The shared buffer on `device`, this process's index of the sender's GPU."""
        return rebuild_cuda_tensor(*with_device(self.rebuild_args, device.index))


def pack_ipc_bucket(flat: torch.Tensor, metadata: BucketMetadata) -> IpcBucket:
    """Share a CUDA flat buffer `[numel]`; the sender must keep `flat` alive until the receivers
    have released it."""
    if flat.device.type != "cuda":
        raise ValueError(f"pack_ipc_bucket: CUDA IPC shares CUDA memory, the bucket is on {flat.device}")
    _, args = reduce_tensor(flat)  # (rebuild_cuda_tensor, args) for a CUDA tensor
    return IpcBucket(metadata, tuple(args))


def with_device(rebuild_args: tuple, device_index: int) -> tuple:
    """`rebuild_args` naming `device_index` (the receiver's index of the same physical GPU)."""
    args = list(rebuild_args)
    args[_DEVICE_ARG] = device_index
    return tuple(args)


class CudaIpcTransport(SharedMemoryTransport):
    """Slot k is the GPU copy of the last bucket written there, kept until it is overwritten (the
    workers have released it) or the sync ends."""

    def __init__(self, readers: int, timeout_s: float = 600.0):
        if not uses_cuda():
            raise RuntimeError(
                "CudaIpcTransport shares GPU memory between colocated processes and needs CUDA, which this "
                "process does not have; use rollout.sync.transport: collective, or shared_memory on CPU"
            )
        super().__init__(readers, timeout_s=timeout_s)
        self._slots: list[torch.Tensor | None] = [None] * SLOTS

    def _open_slots(self) -> None:
        self._slots = [None] * SLOTS

    def _share(self, slot: int, flat: torch.Tensor, metadata: BucketMetadata) -> SharedBucket:
        self._slots[slot] = None  # released by the workers: free it before allocating its successor
        self._slots[slot] = flat.to(torch.device("cuda", torch.cuda.current_device()))
        torch.cuda.current_stream().synchronize()  # the workers read it on their own streams
        return pack_ipc_bucket(self._slots[slot], metadata)

    def _shared_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self._slots if buffer is not None)

    def _close_slots(self) -> None:
        self._slots = [None] * SLOTS
