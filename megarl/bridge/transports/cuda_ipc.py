"""CUDA IPC transport: the GPU adapter of `shared_memory.SharedMemoryTransport` for colocated
GPUs. The sender shares each bucket's GPU buffer by CUDA IPC handle (`reduce_tensor`) instead of a
file; the rollout workers on the same GPU open the handle and load from the sender's memory. Same
delivery, same one-load-per-sync rule. GPU only: constructing it without CUDA raises.

    transport = CudaIpcTransport(deliver=engine.load_shared_buckets)

A handle names the device by the *sender's* index, which differs in a worker that sees other
`CUDA_VISIBLE_DEVICES`: the worker substitutes its own index for the same physical GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from megarl.bridge.transports.shared_memory import Deliver, SharedMemoryTransport
from megarl.workers.rollout.weight_sync_protocol import BucketMetadata, SharedBucket

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
    """Share a CUDA flat buffer `[numel]`; the sender must keep `flat` alive until the receiver has
    loaded it."""
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
    """Moves each bucket to the sender's GPU and shares it by handle; the GPU buffers are kept
    until the delivery returns (the engine has loaded them)."""

    def __init__(self, deliver: Deliver):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaIpcTransport shares GPU memory between colocated processes and needs CUDA, which this "
                "process does not have; use the broadcast transport, or the shared-memory one on CPU"
            )
        super().__init__(deliver)
        self._kept: dict[int, torch.Tensor] = {}

    def _share(self, flat: torch.Tensor, metadata: BucketMetadata) -> SharedBucket:
        shared = flat.to(torch.device("cuda", torch.cuda.current_device()))
        bucket = pack_ipc_bucket(shared, metadata)
        self._kept[id(bucket)] = shared
        return bucket

    def _release(self, bucket: SharedBucket) -> None:
        del self._kept[id(bucket)]
