"""Wall time of each phase of a training step, as `timing/<phase>` seconds.

    timer = PhaseTimer()
    with timer("step"):
        with timer("rollout"):
            ...
        with timer("update_actor"):
            ...
    metrics.update(timer.pop())   # {"timing/step": 3.2, "timing/rollout": 2.1, "timing/update_actor": 0.9}

A phase entered twice in one step (validation over several data sets, say) accumulates.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PHASES: dict[str, str] = {
    "rollout": "generate responses with the rollout engines (trainer.rollout_mode one_step_off, async: the step's "
    "batch, generated while steps before trained: in timing/step only as far as the step waited for it)",
    "reward": "score the responses (one_step_off, async: as timing/rollout)",
    "old_log_prob": "log-probs of the responses under the actor before the update (absent when exactly on-policy: "
    "the update's forward gives them)",
    "ref": "log-probs under the reference model",
    "values": "value estimates of the critic",
    "adv": "advantages and returns",
    "update_critic": "critic optimizer steps",
    "update_actor": "actor optimizer steps",
    "sync": "weight sync actor -> rollout engines, with the engines' weights woken, the actor's side of a checked "
    "sync's check and the Megatron parameters offloaded (engines that do not sleep: their side of the check too)",
    "checkpoint": "saving a checkpoint",
    "offload": "the Megatron training state named by actor/critic.offload off the devices after the update (the "
    "parameters leave with the sync; nothing moves on CPU)",
    "onload": "the offloaded Megatron state back to the devices before the log-prob passes (nothing moves on CPU)",
    "sleep": "rollout engines to sleep (KV cache and weights freed) before the Megatron roles onload",
    "wake_up": "rollout engines' KV cache back after the Megatron offload, with their side of a checked sync's check "
    "(their weights wake with the sync)",
    "validation": "generating and scoring the validation prompts",
    "step": "the whole step, the phases above included",
}
"""Phase name -> what its time covers."""

STARTUP_PHASES: dict[str, str] = {
    "reward": "the reward workers started and their function imported",
    "ray": "the local Ray instance started (or the cluster joined)",
    "megatron": "the Megatron worker groups: processes, process groups, model build, checkpoint load, offload",
    "engines": "the rollout engines built (vLLM: model load, KV cache, warm-up)",
    "weight_sync": "the weight sync connected (the sync group joined, or the shared rings set up)",
    "matmul_peak": "the actor ranks' matmul benchmark, the peak perf/mfu divides by (skipped with trainer.peak_flops)",
    "resume": "a resumed run's checkpoint loaded and synced into the engines",
}
"""Start-up phase name -> what its time covers (one line in the log before step 1: `startup_line`)."""


class PhaseTimer:
    """Accumulates seconds per phase of `phases` until `pop`; `clock` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, phases: dict[str, str] = PHASES):
        self.clock = clock
        self.phases = phases
        self.seconds: dict[str, float] = {}
        self.active: list[str] = []
        """The phases being timed now, outermost first (what a run was doing when it was stopped)."""
        self.failed_in: list[str] | None = None
        """The phases an exception left since the outermost phase was last entered, outermost first (what a
        run was doing when it failed: `active` is empty again by the time the failure is reported)."""

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in self.phases:
            raise ValueError(
                f"unknown timing phase {phase!r}; use one of {', '.join(self.phases)} "
                "(a new phase is added to megarl.cluster.timing's table with its meaning)"
            )
        start = self.clock()
        if not self.active:
            self.failed_in = None
        self.active.append(phase)
        try:
            yield
        except BaseException:
            if self.failed_in is None:  # the innermost phase sees the exception first
                self.failed_in = list(self.active)
            raise
        finally:
            self.active.pop()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + self.clock() - start

    def pop(self) -> dict[str, float]:
        """`{"timing/<phase>": seconds}` of the phases timed since the last `pop`, then starts over."""
        metrics = {f"timing/{phase}": seconds for phase, seconds in self.seconds.items()}
        self.seconds = {}
        return metrics


def startup_line(seconds: dict[str, float]) -> str:
    """The start-up's one log line, from a start-up timer's `pop()`, phases in start order:
    `start-up 27.9 s: reward 0.8 s | ray 2.1 s | megatron 9.8 s | engines 12.3 s | weight_sync 0.4 s`."""
    times = {name.removeprefix("timing/"): value for name, value in seconds.items()}
    phases = " | ".join(f"{phase} {times[phase]:.1f} s" for phase in STARTUP_PHASES if phase in times)
    return f"start-up {sum(times.values()):.1f} s: {phases}"
