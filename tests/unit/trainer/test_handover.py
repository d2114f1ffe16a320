"""The hand-over (`megarl.trainer.handover`) over fake worker groups: the calls of a whole step in
verl's order, which role holds which memory in each phase, and the metrics that record it.

The fakes model one colocated GPU. A Megatron group holds parameters, gradients and optimizer state
(1, 2 and 4 GiB) and frees what its offload settings name; an engine holds weights and a KV cache
(1 and 3 GiB), frees both asleep and gets each back by its wake tag. Each fake reports what it holds
as `device_used_gib`, as `megarl.workers.memory_stats` does on CUDA. The sync is a stand-in that
records the state of both sides when it runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl.config import ConfigError
from megarl.trainer.handover import HandOver, megatron_groups, offload_before_engines
from megarl.trainer.metrics import MEMORY_PHASES, undocumented
from megarl.trainer.timing import PhaseTimer

STATE_GIB = {"params": 1.0, "grads": 2.0, "optimizer": 4.0}
ENGINE_GIB = {"weights": 1.0, "kv_cache": 3.0}
GPU_GIB = 10.0


class Log(list):
    """Every call of every fake, as "<role>.<method>(args)", in order."""


class FakeMegatron:
    """A Megatron group whose ranks offload `offloads` (a subset of STATE_GIB)."""

    def __init__(self, role: str, log: Log, offloads: set[str], world_size: int = 2):
        self.role, self.log, self.offloads, self.world_size = role, log, offloads, world_size
        self.resident = set(STATE_GIB) - offloads  # as `offload_before_engines` leaves it

    def call_all(self, method: str, *args):
        self.log.append(f"{self.role}.{method}")
        if method == "offload_training_state":
            self.resident -= self.offloads & {"grads", "optimizer"}
        elif method == "offload_params":
            self.resident -= self.offloads & {"params"}
        elif method == "onload":
            self.resident = set(STATE_GIB)
        elif method == "free_device_memory":
            return [None] * self.world_size
        return [self.stats()] * self.world_size

    def stats(self) -> dict[str, float]:
        return {"device_used_gib": sum(STATE_GIB[part] for part in self.resident)}


class FakeEngines:
    """The rollout group: engines whose memory sleeps and wakes by vLLM's tags."""

    def __init__(self, log: Log):
        self.log = log
        self.resident = set(ENGINE_GIB)

    def call_all(self, method: str, *args):
        self.log.append(f"rollout.{method}" + (f"({args[0]})" if args else ""))
        if method == "sleep":
            self.resident = set()
        elif method == "wake_up":
            self.resident |= set(args[0])
        return [{"device_used_gib": sum(ENGINE_GIB[part] for part in self.resident)}]


class FakeSync:
    """`WeightSync`: records what each side holds when the weights move and when the engines are checked."""

    def __init__(self, log: Log, actor: FakeMegatron, engines: FakeEngines):
        self.log, self.actor, self.engines = log, actor, engines
        self.seen: dict[str, tuple[set, set]] = {}

    def __call__(self, step: int) -> dict[str, float]:
        self.log.append(f"sync({step})")
        self.seen["sync"] = (set(self.actor.resident), set(self.engines.resident))
        return {"sync/weight_version": float(step)}

    def check_engines(self) -> dict[str, float]:
        self.log.append("check_engines")
        self.seen["check"] = (set(self.actor.resident), set(self.engines.resident))
        return {"sync/logprob_max_abs_diff": 0.0}


def handover(offloads: set[str], engines_sleep: bool = True, critic_group: bool = False):
    log = Log()
    actor = FakeMegatron("actor", log, offloads)
    groups = {"actor": SimpleNamespace(workers=actor), "ref": SimpleNamespace(workers=actor)}
    if critic_group:
        groups["critic"] = SimpleNamespace(workers=FakeMegatron("critic", log, offloads))
    engines = FakeEngines(log)
    roles = SimpleNamespace(groups=groups, rollout=engines)
    sync = FakeSync(log, actor, engines)
    return HandOver(roles, sync, engines_sleep=engines_sleep, timer=PhaseTimer()), log, actor, engines, sync


def device_used(memory: dict[str, float], phase: str) -> float:
    """The GPU's use in `phase`: every role's last report up to it (a role that did not act kept its memory)."""
    order = list(MEMORY_PHASES)
    latest: dict[str, float] = {}
    for name, value in sorted(memory.items(), key=lambda item: order.index(item[0].split("/")[2])):
        _, role, at, _ = name.split("/")
        if order.index(at) <= order.index(phase):
            latest[role] = value
    return sum(latest.values())


def test_a_step_hands_over_in_verls_order():
    step, log, actor, engines, sync = handover(offloads={"params", "grads", "optimizer"})
    step.to_training()
    assert engines.resident == set() and actor.resident == set(STATE_GIB)
    log.append("train")
    metrics = step.to_rollout(3)
    assert log == [
        "actor.memory_stats",
        "rollout.memory_stats",  # after generating
        "rollout.sleep",
        "actor.onload",
        "train",
        "actor.memory_stats",
        "rollout.memory_stats",  # after training
        "actor.offload_training_state",
        "rollout.wake_up(['weights'])",
        "sync(3)",
        "actor.offload_params",
        "rollout.wake_up(['kv_cache'])",
        "check_engines",
    ]
    # The sync finds the actor's parameters (only) beside the engines' weights (only); the check finds
    # the engines fully awake beside nothing of the actor.
    assert sync.seen["sync"] == ({"params"}, {"weights"})
    assert sync.seen["check"] == (set(), {"weights", "kv_cache"})
    assert metrics == {"sync/weight_version": 3.0, "sync/logprob_max_abs_diff": 0.0}


def test_each_phase_records_which_role_holds_what():
    step, *_ = handover(offloads={"params", "grads", "optimizer"})
    step.to_training()
    step.to_rollout(1)
    memory = step.pop_memory()
    assert memory == {
        "memory/actor/generated/device_used_gib": 0.0,
        "memory/rollout/generated/device_used_gib": 4.0,
        "memory/rollout/asleep/device_used_gib": 0.0,
        "memory/actor/onloaded/device_used_gib": 7.0,
        "memory/actor/trained/device_used_gib": 7.0,
        "memory/rollout/trained/device_used_gib": 0.0,
        "memory/actor/training_offloaded/device_used_gib": 1.0,
        "memory/rollout/weights_awake/device_used_gib": 1.0,
        "memory/actor/params_offloaded/device_used_gib": 0.0,
        "memory/rollout/awake/device_used_gib": 4.0,
    }
    assert undocumented(memory) == []
    # Never both sides in full: the most the GPU holds is the trained state alone.
    assert max(device_used(memory, phase) for phase in MEMORY_PHASES) == 7.0
    assert step.pop_memory() == {}


def test_what_is_not_offloaded_stays_beside_the_engines():
    step, _, _actor, _engines, sync = handover(offloads={"optimizer"})
    step.to_training()
    step.to_rollout(1)
    assert sync.seen["sync"] == ({"params", "grads"}, {"weights"})
    assert sync.seen["check"] == ({"params", "grads"}, {"weights", "kv_cache"})
    assert step.pop_memory()["memory/actor/params_offloaded/device_used_gib"] == 3.0


def test_engines_that_never_sleep_are_left_alone():
    step, log, *_ = handover(offloads=set(), engines_sleep=False)
    step.to_training()
    step.to_rollout(1)
    assert not [call for call in log if call.startswith(("rollout.sleep", "rollout.wake_up"))]
    assert "actor.onload" in log and "actor.offload_params" in log


def test_engines_generating_beside_the_training_are_not_called_at_its_start():
    """async: the engines may be generating the next batch at `to_training`; a memory read would wait for it."""
    step, log, *_ = handover(offloads=set(), engines_sleep=False)
    step.engines_generate_beside = True
    step.to_training()
    assert not [call for call in log if call.startswith("rollout.")] and "actor.onload" in log
    step.to_rollout(1)  # the stream holds the generation for the sync: the engines' side runs as ever
    assert "rollout.memory_stats" in log


def test_a_critic_with_a_group_of_its_own_is_handed_over_too():
    step, log, *_ = handover(offloads={"params"}, critic_group=True)
    step.to_training()
    step.to_rollout(1)
    for method in ("onload", "offload_training_state", "offload_params"):
        assert log.count(f"actor.{method}") == log.count(f"critic.{method}") == 1  # the ref shares the actor's
    assert "memory/critic/params_offloaded/device_used_gib" in step.pop_memory()


def test_groups_are_named_by_the_first_role_they_host():
    policy, critic = object(), object()
    groups = {
        "actor": SimpleNamespace(workers=policy),
        "critic": SimpleNamespace(workers=critic),
        "ref": SimpleNamespace(workers=policy),
    }
    assert megatron_groups(groups) == {"actor": policy, "critic": critic}


class FakeGpuGroup(FakeMegatron):
    """A Megatron group on GPUs whose fullest one has `free` of `total` GiB free after offloading."""

    def __init__(self, log: Log, free: float, total: float):
        super().__init__("actor", log, offloads=set())
        self.free, self.total = free, total

    def call_all(self, method: str, *args):
        if method == "free_device_memory":
            self.log.append(f"{self.role}.{method}")
            return [(self.free + 1.0, self.total), (self.free, self.total)]
        return super().call_all(method, *args)


def test_engines_start_after_the_offload_and_within_the_free_memory():
    log = Log()
    group = FakeGpuGroup(log, free=60.0, total=80.0)
    offload_before_engines([SimpleNamespace(workers=group)], gpu_memory_utilization=0.7)
    assert log == ["actor.offload_training_state", "actor.offload_params", "actor.free_device_memory"]
    with pytest.raises(
        ConfigError,
        match=r"rollout.gpu_memory_utilization = 0.8: .* 64.0 GiB of each 80.0 GiB GPU.* "
        r"only 60.0 GiB is free.*use at most 0.75",
    ):
        offload_before_engines([SimpleNamespace(workers=group)], gpu_memory_utilization=0.8)


def test_on_cpu_the_engines_start_whatever_is_free():
    log = Log()
    offload_before_engines([SimpleNamespace(workers=FakeMegatron("actor", log, set()))], gpu_memory_utilization=1.0)
    assert log == ["actor.offload_training_state", "actor.offload_params", "actor.free_device_memory"]
