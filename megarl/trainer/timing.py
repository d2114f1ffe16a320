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
    "rollout": "generate responses with the rollout engines",
    "reward": "score the responses",
    "old_log_prob": "log-probs of the responses under the actor before the update (absent when exactly on-policy: "
                    "the update's forward gives them)",
    "ref": "log-probs under the reference model",
    "values": "value estimates of the critic",
    "adv": "advantages and returns",
    "update_critic": "critic optimizer steps",
    "update_actor": "actor optimizer steps",
    "sync": "weight sync actor -> rollout engines, including the log-prob check",
    "checkpoint": "saving a checkpoint",
    "offload": "the Megatron state named by actor/critic.offload off the devices: training state after the update, "
               "parameters after the sync (nothing moves on CPU)",
    "onload": "the offloaded Megatron state back to the devices before the log-prob passes (nothing moves on CPU)",
    "sleep": "rollout engines to sleep (KV cache and weights freed) before the Megatron roles onload",
    "wake_up": "rollout engines' weights back before the sync, their KV cache after the Megatron offload",
    "validation": "generating and scoring the validation prompts",
    "step": "the whole step, the phases above included",
}
"""Phase name -> what its time covers."""


class PhaseTimer:
    """Accumulates seconds per phase until `pop`; `clock` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in PHASES:
            raise ValueError(f"unknown timing phase {phase!r}; use one of {', '.join(PHASES)} "
                             "(a new phase is added to megarl.trainer.timing.PHASES with its meaning)")
        start = self.clock()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + self.clock() - start

    def pop(self) -> dict[str, float]:
        """`{"timing/<phase>": seconds}` of the phases timed since the last `pop`, then starts over."""
        metrics = {f"timing/{phase}": seconds for phase, seconds in self.seconds.items()}
        self.seconds = {}
        return metrics
