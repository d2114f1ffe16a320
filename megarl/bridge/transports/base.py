"""The transport interface: how the sender (global trainer rank 0) hands the buckets of one sync
to a rollout engine. One implementation per file: `in_process`, `shared_memory` (with its GPU adapter
`cuda_ipc`)."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Protocol

import torch

from megarl.bridge.protocol import BucketMetadata

Buckets = Iterator[tuple[torch.Tensor, BucketMetadata]]
"""One sync's buckets in plan order: `(flat [numel], metadata)`. Lazy: the next bucket is assembled
only when asked for, and the transport must drop a flat buffer before asking for the next one."""


class LoadsWeights(Protocol):
    """What the bridge needs of a rollout engine (`megarl.workers.rollout.base.RolloutEngine`
    implements it): the bridge never imports a rollout backend, the backends import the bridge."""

    def pause(self) -> None:
        """Stop generating until `resume()`."""

    def resume(self) -> None:
        """Generate again."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors handed over in this process."""

    def receive_weights(self, plan) -> Future[None]:
        """Start receiving one sync of `plan` (a `SyncPlan`) over the sync group; done when loaded."""


class WeightTransport(abc.ABC):
    """Moves one sync's buckets from the sender into the engine (or onto the wire to it)."""

    @abc.abstractmethod
    def send(self, buckets: Buckets) -> None:
        """Consume every bucket of one sync; returns when they are handed over (in-process: loaded)."""
