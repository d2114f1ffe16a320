"""What the e2e bridge tests share: the engine side waits for what the training ranks publish in a store."""

from __future__ import annotations

from concurrent.futures import Future, wait

import torch.distributed as dist


def take(store: dist.TCPStore, key: str, trainers: Future) -> bytes:
    """The store's value at `key`, failing at once if the training ranks (`trainers`) fail first."""
    while not store.check([key]):
        if trainers.done():
            trainers.result()  # raises the ranks' failure
            raise RuntimeError(f"the training ranks finished without publishing {key}")
        wait([trainers], timeout=0.5)
    return store.get(key)
