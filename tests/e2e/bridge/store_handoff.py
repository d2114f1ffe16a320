"""What the e2e bridge tests share: the engine side waits for what the training ranks publish in a store,
then loads it into the engine."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait

import torch
import torch.distributed as dist


def take(store: dist.TCPStore, key: str, trainers: Future) -> bytes:
    """The store's value at `key`, failing at once if the training ranks (`trainers`) fail first."""
    while not store.check([key]):
        if trainers.done():
            trainers.result()  # raises the ranks' failure
            raise RuntimeError(f"the training ranks finished without publishing {key}")
        wait([trainers], timeout=0.5)
    return store.get(key)


def load_paused(engine, load: Callable[[], Future], probe: list[list[int]], timeout_s: float) -> torch.Tensor:
    """One sync into `engine`, paused around it (`load()` starts it and returns its future), and the
    engine's probe log-probs after it `[B, T-1]`."""
    engine.pause()
    try:
        load().result(timeout=timeout_s)
    finally:
        engine.resume()
    return torch.stack(engine.prompt_logprobs(probe))
