"""The transport interface: how the sender (global trainer rank 0) hands the buckets of one sync
to a rollout engine. One implementation per file: `in_process`, `shared_memory` (with its GPU adapter
`cuda_ipc`)."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Protocol

import torch

from megarl.bridge.protocol import BucketMetadata
from megarl.bridge.transports.sources import WeightSource

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

    def receive(self, source: WeightSource) -> Future[None]:
        """Start loading one sync from `source` (`sources`); the future completes when loaded."""


class WeightTransport(abc.ABC):
    """Moves one sync's buckets from the sender into the engine (or onto the wire to it)."""

    @abc.abstractmethod
    def send(self, buckets: Buckets) -> None:
        """Consume every bucket of one sync; returns when they are handed over (in-process: loaded)."""
