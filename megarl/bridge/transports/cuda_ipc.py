"""CUDA IPC buffers for the shared ring: the GPU kind of `shared_memory.SharedMemoryTransport`'s
slots. The same two-slot ring (`megarl.bridge.shared_ring`) and the same routes
(`megarl.bridge.ring_routes`: colocated, each engine worker reads the ring of the trainer rank on its
own GPU), with a slot being a GPU buffer of the sender shared by CUDA IPC handle (`reduce_tensor`)
instead of a file: the sender moves bucket i to its GPU and keeps that buffer as slot i % 2 until
its reader releases it, and the rollout worker on the same GPU opens the handle and loads from the
sender's memory. GPU only: constructing the transport without CUDA raises.

    transport = CudaIpcTransport(readers=1)        # then as SharedMemoryTransport: begin, send

A handle names its GPU by device UUID (`torch.cuda.get_device_properties(i).uuid`), not by index:
indices differ between processes that see different `CUDA_VISIBLE_DEVICES` (Ray gives each worker
its own), a UUID does not. The receiver maps the UUID to its own index of that GPU (`local_index`)
and refuses a handle whose GPU it does not see or that is not its own device (the ring routes pair
every worker with the trainer rank on its own GPU, so anything else is a routing bug).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from megarl.bridge.protocol import BucketMetadata, SharedBucket
from megarl.bridge.shared_ring import SLOTS
from megarl.bridge.transports.shared_memory import SharedMemoryTransport
from megarl.parallel.device import uses_cuda

_DEVICE_ARG = 6
"""Position of the storage device in `rebuild_cuda_tensor`'s arguments (torch 2.x: `storage_device`)."""


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index`: the same string in every process on the node."""
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_uuids() -> list[str]:
    """The UUIDs of this process's CUDA devices, by local index."""
    return [device_uuid(index) for index in range(torch.cuda.device_count())]


def local_index(uuid: str, visible: Sequence[str], own: int | None) -> int:
    """This process's index of the GPU `uuid`, given its `visible` UUIDs (by local index) and its
    `own` device index (None: any visible GPU will do). Raises RuntimeError when the GPU is not
    visible here or is not `own`."""
    if uuid not in visible:
        raise RuntimeError(
            f"CUDA IPC weight sync: a bucket lives on GPU {uuid}, which this process does not see (its "
            f"CUDA_VISIBLE_DEVICES give {list(visible)}); a colocated engine worker must read the ring of the "
            "trainer rank on its own GPU (megarl.bridge.ring_routes), or use rollout.sync.transport: collective "
            "for engines on other GPUs"
        )
    index = visible.index(uuid)
    if own is not None and index != own:
        raise RuntimeError(
            f"CUDA IPC weight sync: a bucket lives on GPU {uuid} (cuda:{index} here) but this worker runs on "
            f"cuda:{own} ({visible[own]}); opening it would read another GPU's memory. The ring routes must pair "
            "each engine worker with the trainer rank on its own GPU (megarl.bridge.ring_routes)"
        )
    return index


@dataclass(frozen=True)
class IpcBucket(SharedBucket):
    """One bucket shared by CUDA IPC handle: picklable, a few hundred bytes whatever its size."""

    metadata: BucketMetadata
    """The bucket's tensors (names, shapes, offsets)."""
    device_uuid: str
    """The GPU holding the buffer (`device_uuid`), which keys the handle across processes."""
    rebuild_args: tuple
    """`rebuild_cuda_tensor` arguments of the flat buffer (from `reduce_tensor`), handle included;
    the device among them is the sender's index, replaced by the receiver's on `open`."""

    def open(self, device: torch.device) -> torch.Tensor:
        """The shared buffer, on this process's index of the bucket's GPU, which must be `device`."""
        index = local_index(self.device_uuid, visible_uuids(), device.index)
        return rebuild_cuda_tensor(*with_device(self.rebuild_args, index))


def pack_ipc_bucket(flat: torch.Tensor, metadata: BucketMetadata) -> IpcBucket:
    """Share a CUDA flat buffer `[numel]`; the sender must keep `flat` alive until the receivers
    have released it."""
    if flat.device.type != "cuda":
        raise ValueError(f"pack_ipc_bucket: CUDA IPC shares CUDA memory, the bucket is on {flat.device}")
    _, args = reduce_tensor(flat)  # (rebuild_cuda_tensor, args) for a CUDA tensor
    return IpcBucket(metadata, device_uuid(flat.device.index), tuple(args))


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
