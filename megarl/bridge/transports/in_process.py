"""In-process transport: the rollout engine lives in the sender's process (colocated, TP 1)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megarl.bridge.protocol import unpack
from megarl.bridge.transports.base import Buckets, LoadsWeights, WeightTransport
from megarl.bridge.transports.sources import InProcessTensors


def _named_tensors(buckets: Buckets) -> Iterator[tuple[str, torch.Tensor]]:
    for flat, metadata in buckets:
        yield from unpack(flat, metadata)


class InProcessTransport(WeightTransport):
    """Hands the buckets to the engine as one lazy stream of HF-named tensors (`InProcessTensors`): one load
    per sync (a fused vLLM layer needs all its parts within one load), one bucket alive at a time."""

    def __init__(self, engine: LoadsWeights):
        self.engine = engine

    def send(self, buckets: Buckets) -> None:
        self.engine.receive(InProcessTensors(_named_tensors(buckets))).result()
