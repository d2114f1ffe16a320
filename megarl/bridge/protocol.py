"""The wire format of a weight sync: tensors travel in flat buckets described by small metadata.

A sender packs HF-named full tensors into one flat 1-D buffer per bucket; the receivers (rollout
workers) view the tensors back out of it. The buffer stays where the sender put it and is shared
by handle (`SharedBucket`: shared memory on CPU, CUDA IPC on GPU), or is built by the receiver
itself from the pieces the trainer ranks send (`shard_sync`: the metadata lays out where each
piece lands). Metadata travels by RPC, so it must stay small and picklable. All tensors of a bucket share
one dtype (the buffer's); the sender starts a new bucket when the dtype changes.

    flat, meta = pack([("model.norm.weight", w1), ("lm_head.weight", w2)])
    assert [n for n, _ in unpack(flat, meta)] == ["model.norm.weight", "lm_head.weight"]

Pure functions: no processes, no vLLM.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies in a bucket's flat buffer."""

    name: str
    """HF parameter name, e.g. `model.layers.0.self_attn.q_proj.weight`."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    dtype: torch.dtype
    """The tensor's dtype (equal to the bucket's)."""
    offset: int
    """First element in the flat buffer (in elements, not bytes)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketMetadata:
    """One bucket: its tensors in buffer order, packed back to back from offset 0."""

    slots: tuple[TensorSlot, ...]
    """The tensors of the bucket, in the order they were packed."""

    @property
    def dtype(self) -> torch.dtype:
        return self.slots[0].dtype

    @property
    def numel(self) -> int:
        """Elements of the flat buffer."""
        last = self.slots[-1]
        return last.offset + last.numel


class SharedBucket(abc.ABC):
    """One bucket whose flat buffer the sender shares by handle: small and picklable, opened in
    place by the receiving processes (each rollout worker of the engine), so no bytes are copied on
    the way. Implementations: `megarl.bridge.transports.shared_memory` (CPU) and `cuda_ipc` (GPU).
    The sender keeps the buffer until every receiver has released it (`shared_ring`)."""

    metadata: BucketMetadata
    """The bucket's tensors (names, shapes, offsets)."""

    @abc.abstractmethod
    def open(self, device: torch.device) -> torch.Tensor:
        """The flat buffer `[metadata.numel]`, mapped in this process (a view, no copy); `device`:
        this process's device holding it (a GPU's index differs between processes)."""


def pack(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, BucketMetadata]:
    """Concatenate tensors into a flat buffer `[sum numel]` on their device, each copied once (and
    cast to `dtype` when given), and describe it. Without `dtype` the tensors must share one.
    Raises ValueError for an empty bucket or mixed dtypes."""
    named_tensors = list(named_tensors)
    if not named_tensors:
        raise ValueError("pack: a bucket needs at least one tensor")
    if dtype is None:
        dtype = named_tensors[0][1].dtype
        for name, tensor in named_tensors:
            if tensor.dtype != dtype:
                raise ValueError(
                    f"pack: tensor {name!r} is {tensor.dtype} but the bucket is {dtype} "
                    f"(from {named_tensors[0][0]!r}); put tensors of different dtypes in separate buckets"
                )
    slots, offset = [], 0
    for name, tensor in named_tensors:
        slots.append(TensorSlot(name, tuple(tensor.shape), dtype, offset))
        offset += tensor.numel()
    flat = torch.empty(offset, dtype=dtype, device=named_tensors[0][1].device)
    for slot, (_, tensor) in zip(slots, named_tensors):
        flat[slot.offset : slot.offset + slot.numel].view(slot.shape).copy_(tensor)
    return flat, BucketMetadata(tuple(slots))


def unpack(flat: torch.Tensor, metadata: BucketMetadata) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views into `flat` (no copy), in packing order."""
    if flat.dim() != 1 or flat.numel() != metadata.numel or flat.dtype != metadata.dtype:
        raise ValueError(
            f"unpack: buffer {flat.dtype} {tuple(flat.shape)} does not match the metadata "
            f"({metadata.dtype}, {metadata.numel} elements)"
        )
    return [(slot.name, flat[slot.offset : slot.offset + slot.numel].view(slot.shape)) for slot in metadata.slots]
