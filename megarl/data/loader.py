"""Batches of prompts, epoch after epoch, in an order that is a pure function of (seed, epoch).

    loader = PromptLoader(prompts, batch_size=16, shuffle=True, seed=0)
    batch = next(loader)                 # list[Prompt] of 16; epochs roll over forever
    state = loader.state_dict()          # {"epoch", "position", ...}: store it in the checkpoint
    resumed = PromptLoader(prompts, batch_size=16, shuffle=True, seed=0)
    resumed.load_state_dict(state)       # next(resumed) is the batch next(loader) would give

Training drops an epoch's last partial batch (every step has `batch_size` prompts, as in verl);
with shuffling, the prompts it drops differ from epoch to epoch. Validation takes every prompt once,
in file order: `iter_batches`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from megarl.data.files import DataError
from megarl.data.prompts import Prompt

STATE_VERSION = 1


class PromptLoader:
    """An endless iterator of training batches; its position is checkpointable."""

    def __init__(self, prompts: Sequence[Prompt], batch_size: int, *, shuffle: bool, seed: int):
        if batch_size < 1:
            raise ValueError(f"PromptLoader: batch_size must be >= 1, got {batch_size}")
        if len(prompts) < batch_size:
            raise DataError(
                f"data.train_batch_size {batch_size} is larger than the {len(prompts)} training prompts "
                "kept; lower data.train_batch_size or add prompts"
            )
        self.prompts = prompts
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        """Epoch of the next batch (0-based)."""
        self.position = 0
        """Prompts of `epoch` already handed out."""
        self._order = self.epoch_order(self.epoch)

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per pass over the prompts."""
        return len(self.prompts) // self.batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        """Indices of `prompts` in the order of `epoch`: a permutation seeded by (seed, epoch), or 0..N-1."""
        order = list(range(len(self.prompts)))
        if self.shuffle:
            # A string seed goes through SHA-512: stable across Python versions and platforms.
            random.Random(f"megarl.data/{self.seed}/{epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def __next__(self) -> list[Prompt]:
        if self.position + self.batch_size > len(self.prompts):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self.epoch_order(self.epoch)
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.prompts[index] for index in indices]

    def state_dict(self) -> dict[str, int | bool]:
        """The position (epoch, prompts consumed) and what the order depends on, to check on resume."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "num_prompts": len(self.prompts),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Continue where `state` was taken. The prompts and their shuffling must be those of the saved run."""
        current = self.state_dict()
        changed = [
            f"{key} {state[key]} → {current[key]}"
            for key in ("version", "num_prompts", "shuffle", "seed")
            if state[key] != current[key]
        ]
        if changed:
            raise DataError(
                f"the checkpoint's data-loader position does not fit this run's data ({', '.join(changed)}): "
                "resume with the same data files, filtering and data.shuffle/data.seed, or start fresh "
                "(checkpoint.resume: disable)"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self.epoch_order(self.epoch)


def iter_batches(prompts: Sequence[Prompt], batch_size: int | None) -> Iterator[list[Prompt]]:
    """Every prompt once, in order, in batches of `batch_size` (the last may be smaller); None: one batch."""
    size = len(prompts) if batch_size is None else batch_size
    for start in range(0, len(prompts), size):
        yield list(prompts[start : start + size])
