"""When each step's batch is generated, and with which weights (`trainer.rollout_mode`).

sync (`lookahead` 0): a step generates its batch when it starts, with the weights the previous step
trained. one_step_off (`lookahead` 1): the engines generate step k+1's batch in a driver thread while
the actor trains on step k's (split placement: the two sides have devices of their own), with the
weights they hold, which are one version old:

    gen(b1, w0) ; [train(b1) ∥ gen(b2, w0)] ; sync w1 ; [train(b2) ∥ gen(b3, w1)] ; sync w2 ; ...

The trainer drives it so each step (a checkpoint `settle`s first and saves `state_dict`; after a failure
elsewhere, `close` once the engines are stopped):

    batch = stream.take(step)        # step's batch: generated now (sync, or none ahead), or the one ahead
    cluster.to_training()            # the engines idle: their memory snapshot does not queue behind a generation
    stream.start_next(step)          # one_step_off: step + 1's batch, in the thread
    ... train on batch ...
    stream.sync(step, cluster.to_rollout)    # waits for the generation in flight, then loads w_step

A rollout worker is a Ray actor that runs one call at a time, so the main thread calls the engines
only while no generation is in flight; everything the generation touches (engines, reward scorer,
tools, data loader) is the thread's alone between `start_next` and the next `take`/`settle`/`sync`.
The generation's own `PhaseTimer` times it (`timing/rollout`, `timing/reward` of the batch, logged with
the step that trains it). A generation that fails raises its error in the main thread at the next
`take`, `settle` or `sync`, with the phases it failed in as the trainer timer's `failed_in` (what the
CLI names) and a note naming the batch's step.

Each batch records the weight version it was generated with; the step that trains it logs
`rollout/policy_version_lag/{mean,max}`: the versions the actor (which holds step - 1's weights when
step trains) is ahead of the batch: 0 in sync, 1 in one_step_off from the second step on. A checkpoint
keeps the batch generated ahead (`state_dict`), so a resume trains on that very batch and goes on
exactly as the uninterrupted run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from megarl.cluster.timing import PhaseTimer
from megarl.data import Prompt
from megarl.trainer import generated
from megarl.trainer.generated import GeneratedBatch

Generate = Callable[[int, int], GeneratedBatch]
"""`generate(step, policy_version)`: step's batch from the engines as they are, which hold the weights of
version `policy_version` (recorded in the batch)."""


class RolloutStream:
    """Generates each step's batch `lookahead` (0 or 1) steps ahead of the training."""

    def __init__(
        self,
        generate: Generate,
        gen_timer: PhaseTimer,
        timer: PhaseTimer,
        *,
        lookahead: int,
        last_step: int,
        version: int,
    ):
        """`gen_timer`: the timer `generate` times its phases with: the trainer's own `timer` when
        `lookahead` is 0 (the generation runs inside the step, as any phase), one of its own otherwise
        (popped into each batch's metrics); `version`: the weight version the engines hold now (the step
        of the checkpoint a resume loaded, else 0)."""
        assert lookahead in (0, 1) and (gen_timer is timer) == (lookahead == 0), (lookahead, gen_timer, timer)
        self.generate = generate
        self.gen_timer = gen_timer
        self.timer = timer
        self.lookahead = lookahead
        self.last_step = last_step
        self.version = version
        self.ahead: GeneratedBatch | None = None
        """The next step's batch, once generated ahead (and not yet taken)."""
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """What the generation in the thread raised, until the main thread raises it."""
        self.failed_in: list[str] = []
        """The generation timer's phases `error` left."""

    def take(self, step: int) -> GeneratedBatch:
        """`step`'s batch, with `rollout/policy_version_lag/*` in its metrics: the one generated ahead, or
        (none ahead: the first step, every sync step) one generated now."""
        if self.ahead is None and self.thread is None:
            if not self.lookahead:
                return self._with_lag(self.generate(step, self.version), step)  # here: errors raise as they are
            self._start(step)
        self.settle()
        batch, self.ahead = self.ahead, None
        return self._with_lag(batch, step)

    def start_next(self, step: int) -> None:
        """After `take(step)`: one_step_off generates step + 1's batch in the thread (none after the last step)."""
        if self.lookahead and step < self.last_step:
            self._start(step + 1)

    def settle(self) -> None:
        """Wait for the generation in flight, if any; raise its error here."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            # The trainer's timer is inside `step` here: the generation's phases are where the step failed.
            self.timer.failed_in = [*self.timer.active, *self.failed_in]
            raise error

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No generation in flight inside: the engines are the caller's (validation)."""
        self.settle()
        yield

    def sync(self, step: int, to_rollout: Callable[[int], dict[str, float]]) -> dict[str, float]:
        """The engines load the weights trained up to `step` (`to_rollout(step)`, the hand-over), once
        the generation in flight is done: never mid-generation. Its metrics."""
        self.settle()
        metrics = to_rollout(step)
        self.version = step
        return metrics

    def close(self) -> None:
        """Wait for a generation still in flight and drop its result or error (after a failure elsewhere:
        call it once the engines are stopped, so that the generation ends at once)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.ahead, self.error = None, None

    def state_dict(self, prompts: Sequence[Prompt]) -> dict:
        """For a checkpoint, once `settle`d: the batch generated ahead (JSON), or None."""
        assert self.thread is None, "settle() before saving the stream's state"
        return {"ahead": None if self.ahead is None else generated.encode(self.ahead, prompts)}

    def load_state_dict(self, state: dict | None, prompts: Sequence[Prompt]) -> None:
        """Continue from a checkpoint's `state_dict` (None: a checkpoint without one: nothing ahead)."""
        ahead = (state or {}).get("ahead")
        self.ahead = None if ahead is None else generated.decode(ahead, prompts)

    def _start(self, step: int) -> None:
        self.thread = threading.Thread(target=self._run, args=(step,), name=f"rollout-stream-step-{step}", daemon=True)
        self.thread.start()

    def _run(self, step: int) -> None:
        """The thread: `step`'s batch into `ahead`, or what it raised kept for the main thread."""
        try:
            batch = self.generate(step, self.version)  # no sync before this generation ends
        except BaseException as error:
            error.add_note(f"raised generating the batch of step {step} ahead (trainer.rollout_mode: one_step_off)")
            self.error, self.failed_in = error, list(self.gen_timer.failed_in or [])
            return
        batch.metrics |= self.gen_timer.pop()
        self.ahead = batch

    @staticmethod
    def _with_lag(batch: GeneratedBatch, step: int) -> GeneratedBatch:
        """The actor holds the weights of step - 1 while `step` trains: the batch is that many versions behind."""
        lag = float(step - 1 - batch.policy_version)
        batch.metrics |= {"rollout/policy_version_lag/mean": lag, "rollout/policy_version_lag/max": lag}
        return batch
