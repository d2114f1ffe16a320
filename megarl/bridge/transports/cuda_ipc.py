"""CUDA IPC transport: colocated GPUs. The sender shares each bucket's GPU buffer by CUDA IPC
handle instead of copying it; the rollout worker on the same GPU opens the handle and loads from
the shared memory. GPU only: constructing it without CUDA raises.

    transport = CudaIpcTransport(deliver=lambda ipc: engine_rpc("receive_ipc_bucket", ipc))
    # worker side:  named_tensors = open_ipc_bucket(ipc, torch.cuda.current_device())

The pure part is the handle packing (`pack_ipc_bucket` / `open_ipc_bucket`): a handle names the
device by the *sender's* index, which differs in a worker that sees other `CUDA_VISIBLE_DEVICES`;
the worker substitutes its own index for the same physical GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from megarl.bridge.transports.base import Buckets, WeightTransport
from megarl.workers.rollout.weight_sync_protocol import BucketMetadata, unpack

_DEVICE_ARG = 6
"""Position of the storage device in `rebuild_cuda_tensor`'s arguments (torch 2.x)."""


@dataclass(frozen=True)
class IpcBucket:
    """One bucket shared by handle: picklable, a few hundred bytes whatever the bucket size."""

    metadata: BucketMetadata
    """The bucket's tensors (names, shapes, offsets)."""
    rebuild_args: tuple
    """`rebuild_cuda_tensor` arguments of the flat buffer (from `reduce_tensor`), handle included."""


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


def open_ipc_bucket(bucket: IpcBucket, device_index: int) -> list[tuple[str, torch.Tensor]]:
    """Receiver side: the bucket's HF-named tensors as views into the shared buffer."""
    flat = rebuild_cuda_tensor(*with_device(bucket.rebuild_args, device_index))
    return unpack(flat, bucket.metadata)


class CudaIpcTransport(WeightTransport):
    """Moves each bucket to the sender's GPU and passes its handle to `deliver`, which must return
    once the colocated rollout worker has loaded the bucket (the buffer is freed after it)."""

    def __init__(self, deliver: Callable[[IpcBucket], None]):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaIpcTransport shares GPU memory between colocated processes and needs CUDA, which this "
                "process does not have; use the broadcast transport (gloo on CPU) or the in-process one"
            )
        self.deliver = deliver

    def send(self, buckets: Buckets) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        for flat, metadata in buckets:
            shared = flat.to(device, non_blocking=False)
            self.deliver(pack_ipc_bucket(shared, metadata))
            del shared
