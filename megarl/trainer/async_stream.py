"""`trainer.rollout_mode: async`: a driver thread generates batch after batch while the actor trains, as
far ahead as the staleness bound allows (`trainer.max_staleness`, η; AReaL's bounded staleness).

The batch of step g is trained when the actor holds the weights of step g - 1; generated with the
weights of version v it is g - 1 - v versions stale. The thread starts batch g only once the engines
hold version v >= g - 1 - η, so no batch it makes can exceed the bound; with the trainer keeping up
the engines never wait, up to η + 1 batches run ahead of the training (with `rollout.over_sampling` the
thread keeps one version of the bound for the groups a batch carries into the next: v >= g - 1 - (η - 1)):

    η = 2:  gen(b1, w0) gen(b2, w0) gen(b3, w0 | w1) ...    (b3 waits for nothing: 3 - 1 - 2 = 0)
            [train(b1) ............] sync w1 [train(b2) ...] sync w2 ...

`take` checks the bound again on every batch, on its oldest token: one over it (a checkpoint's batch
resumed under a smaller `max_staleness`) is dropped and the step's batch generated afresh with the
current weights, never trained on; `rollout/stale_dropped_samples` counts the samples dropped.

Partial rollouts (`rollout.partial_rollout`, `megarl.rollout.partial`): the generation calls
`between_segments` every few tokens (the agent loop also before each turn, `megarl.rollout.multi_turn`),
where the thread lets a waiting weight load (or validation, or a checkpoint) in and goes on with the
weights it brought; each token keeps its version (`Samples.token_versions`), logged as
`rollout/token_version_lag/mean` and `rollout/partial_samples`.
A checkpoint then no longer waits for a whole generation: the batch in flight is lost (its prompts were
taken from the data loader), and a resume says so and generates that step's batch from the next prompts.

The trainer drives it as `RolloutStream`. A rollout worker runs one call at a time and the engines,
reward scorer, tools and data loader are the thread's while it generates, so every main-thread use of
them waits for the generation in flight and holds the thread meanwhile: `sync` (the weights load
between two generations, never into one), `paused` (validation) and `settle` (a checkpoint: the
batches generated ahead are saved with the data position after them; the thread waits until the
step's sync). Without partial rollouts a checkpoint thus loses nothing generated before it; a resume
trains on its batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from megarl.cluster.timing import PhaseTimer
from megarl.data import Prompt
from megarl.trainer import generated
from megarl.trainer.generated import GeneratedBatch
from megarl.trainer.rollout_stream import Generate


class AsyncRolloutStream:
    """Generates the batches of the coming steps in a thread, each at most `max_staleness` versions stale
    when trained."""

    def __init__(
        self,
        generate: Generate,
        gen_timer: PhaseTimer,
        timer: PhaseTimer,
        *,
        max_staleness: int,
        last_step: int,
        version: int,
        carried_room: int = 0,
    ):
        """`gen_timer`: the thread's own timer (popped into each batch's metrics); `version`: the weight
        version the engines hold now (the step of the checkpoint a resume loaded, else 0); `carried_room`:
        versions of the bound kept for groups carried from one batch into the next (`rollout.over_sampling`:
        1, so that a group carried from the batch before is within the bound, not started over)."""
        assert gen_timer is not timer and 0 <= carried_room <= max_staleness, (gen_timer, timer, max_staleness)
        self.generate = generate
        self.gen_timer = gen_timer
        self.timer = timer
        self.max_staleness = max_staleness
        self.lead = max_staleness - carried_room
        """The most versions a batch is stale when its generation starts."""
        self.last_step = last_step
        self.version = version
        self.ready: dict[int, GeneratedBatch] = {}
        """Batches generated and not yet taken, by the step that trains them."""
        self.next_step = version + 1
        """The step whose batch the thread generates next."""
        self.generating = False
        self.in_flight: int | None = None
        """The step whose batch the thread is making (also while it waits between two segments)."""
        self.held = False
        """The main thread uses the engines (or is about to): the thread starts no generation."""
        self.stopping = False
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.failed_in: list[str] = []

    def take(self, step: int) -> GeneratedBatch:
        """`step`'s batch, with `rollout/policy_version_lag/*` and `rollout/stale_dropped_samples` in its
        metrics, once the thread made it (started here at the first step)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="rollout-stream-async", daemon=True)
            self.thread.start()
        with self.cond:
            self.cond.wait_for(lambda: step in self.ready or self.error is not None)
            self._raise_error()
            batch = self.ready.pop(step)
        dropped = 0
        if step - 1 - oldest_version(batch) > self.max_staleness:
            dropped = len(batch.samples)
            with self.paused():  # the engines are the main thread's until the step's batch is made again
                making, self.in_flight = self.in_flight, self.in_flight or step  # or the thread's, suspended
                batch = self.generate(step, self.version)
                batch.metrics |= self.gen_timer.pop()
                self.in_flight = making
        batch.metrics |= {"rollout/stale_dropped_samples": float(dropped)} | token_version_metrics(batch, step)
        batch.metrics |= sample_lag_metrics(batch, step)
        return batch

    def between_segments(self) -> int:
        """Called by the generation between two segments of a partial rollout: in the thread, a sync,
        validation or checkpoint waiting for the engines goes first. The weight version the engines hold."""
        with self.cond:
            if self.held and threading.current_thread() is self.thread:  # not the main thread's own generation
                self.generating = False
                self.cond.notify_all()
                self.cond.wait_for(lambda: not self.held or self.stopping)
                self.generating = True
            return self.version

    def oldest_allowed_version(self) -> int:
        """The oldest weight version a token of the batch being made may come from: that batch's step - 1 -
        max_staleness (`megarl.rollout.carry.CarryOver` starts older carried groups over)."""
        assert self.in_flight is not None, "asked outside a generation"
        return self.in_flight - 1 - self.max_staleness

    def start_next(self, step: int) -> None:
        """Nothing to start: the thread generates ahead on its own."""

    def settle(self) -> None:
        """Wait for the generation in flight (partial rollouts: for its current segment), then hold the thread
        until the next `sync`; raise what it raised."""
        with self.cond:
            self.held = True
            self.cond.notify_all()  # for whoever waits for the engines to be wanted
            self.cond.wait_for(lambda: not self.generating)
            self._raise_error()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The engines, scorer and data loader are the caller's inside (no generation in flight)."""
        self.settle()
        try:
            yield
        finally:
            self._release()

    def sync(self, step: int, to_rollout: Callable[[int], dict[str, float]]) -> dict[str, float]:
        """The engines load the weights trained up to `step` between two generations; the thread goes on
        with them. The hand-over's metrics."""
        with self.paused():
            metrics = to_rollout(step)
            self.version = step
        return metrics

    def close(self) -> None:
        """Stop the thread, waiting for a generation still in flight, and drop what it made (call it once
        the engines are stopped, so that the generation ends at once)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.ready, self.error = {}, None

    def state_dict(self, prompts: Sequence[Prompt]) -> dict:
        """For a checkpoint, once `settle`d: the batches generated ahead (JSON), by step."""
        assert self.held and not self.generating, "settle() before saving the stream's state"
        return {
            "ready": {str(step): generated.encode(batch, prompts) for step, batch in sorted(self.ready.items())},
            "in_flight": self.in_flight,
        }

    def load_state_dict(self, state: dict | None, prompts: Sequence[Prompt]) -> None:
        """Continue from a checkpoint's `state_dict` (an async run's, or one_step_off's batch ahead, or
        None); prints what the resume kept."""
        state = state or {}
        ready = state.get("ready") or ({} if state.get("ahead") is None else {str(self.version + 1): state["ahead"]})
        self.ready = {int(step): generated.decode(batch, prompts) for step, batch in ready.items()}
        self.next_step = self.version + 1 + len(self.ready)
        if state:
            lost = state.get("in_flight")
            print(
                f"rollout stream: resumed with {len(self.ready)} batch(es) generated before the checkpoint "
                f"(steps {sorted(self.ready)}); "
                + (
                    "no batch was in flight"
                    if lost is None
                    else f"the batch of step {lost} was in flight and is lost: it is generated again from the next prompts"
                )
                + _carried_lost(state.get("carried_lost")),
                flush=True,
            )

    def _may_start(self) -> bool:
        """The thread may generate `next_step`'s batch: it starts at most `lead` versions stale."""
        return not self.held and self.version >= self.next_step - 1 - self.lead

    def _run(self) -> None:
        """The thread: each coming step's batch into `ready`, until the last step, a stop or an error."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stopping or self.next_step > self.last_step or self._may_start())
                if self.stopping or self.next_step > self.last_step:
                    return
                step, version = self.next_step, self.version
                self.next_step, self.generating, self.in_flight = step + 1, True, step
            try:
                batch = self.generate(step, version)
                batch.metrics |= self.gen_timer.pop()
            except BaseException as error:
                error.add_note(f"raised generating the batch of step {step} ahead (trainer.rollout_mode: async)")
                with self.cond:
                    self.error, self.failed_in, self.generating = error, list(self.gen_timer.failed_in or []), False
                    self.in_flight = None
                    self.cond.notify_all()
                return
            with self.cond:
                self.ready[step], self.generating, self.in_flight = batch, False, None
                self.cond.notify_all()

    def _release(self) -> None:
        with self.cond:
            self.held = False
            self.cond.notify_all()

    def _raise_error(self) -> None:
        """Under `cond`: raise what the thread raised, its phases as the trainer timer's `failed_in`."""
        if self.error is not None:
            error, self.error = self.error, None
            self.timer.failed_in = [*self.timer.active, *self.failed_in]
            raise error


def _carried_lost(lost: dict | None) -> str:
    """What the resume says of the generation `rollout.over_sampling` carried (nothing without it)."""
    if lost is None:
        return ""
    return (
        f"; rollout.over_sampling: {lost['groups']} group(s) in flight and {lost['prompts']} prompt(s) not "
        "started yet are lost (the data goes on after them)"
    )


def oldest_version(batch: GeneratedBatch) -> int:
    """The weight version of the batch's oldest token (partial rollouts: a sample may span several)."""
    return min([batch.policy_version, *(min(v) for v in batch.samples.token_versions if v)])


def sample_lag_metrics(batch: GeneratedBatch, step: int) -> dict[str, float]:
    """`rollout/policy_version_lag/{mean,max}` over the samples, each as stale as its oldest token (partial
    rollouts: a sample carried from an earlier call, `rollout.over_sampling`, holds tokens older than the
    batch's start) or, without per-token versions, as the batch: the actor holds step - 1's weights."""
    lags = [step - 1 - (min(v) if v else batch.policy_version) for v in batch.samples.token_versions]
    return {
        "rollout/policy_version_lag/mean": sum(lags) / len(lags),
        "rollout/policy_version_lag/max": float(max(lags)),
    }


def token_version_metrics(batch: GeneratedBatch, step: int) -> dict[str, float]:
    """Partial rollouts: `rollout/token_version_lag/mean` (versions the actor, at step - 1, is ahead of the
    weights that sampled each token the model wrote, mean over them: a multi-turn sample's observation
    tokens are not the model's) and `rollout/partial_samples` (samples whose tokens came from more than one
    version); nothing for a batch without per-token versions."""
    samples = batch.samples
    versions = [
        [x for x, mine in zip(v, mask.tolist(), strict=True) if mine]
        for v, mask in zip(samples.token_versions, samples.loss_masks, strict=True)
        if v is not None
    ]
    if not versions:
        return {}
    tokens = sum(map(len, versions))
    return {
        "rollout/token_version_lag/mean": sum(step - 1 - x for v in versions for x in v) / max(tokens, 1),
        "rollout/partial_samples": float(sum(len(set(v)) > 1 for v in versions)),
    }
