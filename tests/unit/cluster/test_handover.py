"""The hand-over (`megarl.cluster.handover`) over fake worker groups: the calls of a whole step in
verl's order, one round trip per group per phase, the memory order between the groups, which role
holds which memory in each phase, and the metrics that record it.

The fakes model one colocated GPU. A Megatron group holds parameters, gradients and optimizer state
(1, 2 and 4 GiB) and frees what its offload settings name; an engine holds weights and a KV cache
(1 and 3 GiB), frees both asleep and gets each back by its wake tag. Each fake reports what it holds
as `device_used_gib`, as `megarl.workers.memory_stats` does on CUDA. The sync is the run's
`WeightSync`, whose calls the fakes answer, recording the state of both sides when the weights move
and when the engines are checked. A fake group runs a chain of calls when it is submitted and logs
"<role> answered" when the driver collects the answers: a call the driver starts before it collected
an earlier one may run beside it (`assert_finished_before`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.bridge.checksum import LoadedChecksums
from megarl.cluster.handover import HandOver, megatron_groups, offload_before_engines
from megarl.cluster.memory_metrics import MEMORY_PHASES
from megarl.cluster.sync_step import WeightSync
from megarl.cluster.timing import PhaseTimer
from megarl.config.loader import load_config
from megarl.config.problems import ConfigError
from megarl.orchestration.worker_group import Call
from megarl.trainer.metrics import undocumented

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
STATE_GIB = {"params": 1.0, "grads": 2.0, "optimizer": 4.0}
ENGINE_GIB = {"weights": 1.0, "kv_cache": 3.0}
GPU_GIB = 10.0
PROBE_LOG_PROBS = -torch.ones(4, 7)


class Log(list):
    """Every call of every fake, as "<role>.<method>(args)", and "<role> answered", in order."""


class FakeGroup:
    """A worker group of `world_size` ranks that share one state (`model`): a chain runs on it when
    submitted (each call logged), its answers are collected later (logged then)."""

    def __init__(self, role: str, log: Log, model, world_size: int):
        self.role, self.log, self.model, self.world_size = role, log, model, world_size
        self.trips = 0

    def submit(self, per_rank_calls: list[list[Call]], replying=None) -> FakeAnswers:
        assert len({tuple(c.method for c in calls) for calls in per_rank_calls}) == 1, "one chain for all ranks"
        self.trips += 1
        answers = []
        for call in per_rank_calls[0]:
            self.log.append(f"{self.role}.{call.method}" + (f"({call.args[0]})" if call.method == "wake_up" else ""))
            answers.append(getattr(self.model, call.method)(*call.args))
        return FakeAnswers(self, [answers] * self.world_size)

    def chain(self, *calls: Call) -> list[list]:
        return self.submit([list(calls)] * self.world_size).wait()

    def call_all(self, method: str, *args) -> list:
        return [answers[0] for answers in self.chain(Call(method, args))]

    def call_rank0(self, method: str, *args):
        return self.call_all(method, *args)[0]


class FakeAnswers:
    """`PendingCall` of a `FakeGroup`."""

    def __init__(self, group: FakeGroup, answers: list):
        self.group, self.answers, self.collected = group, answers, False

    def poll(self, timeout_s: float) -> bool:
        return True

    def wait(self) -> list:
        if not self.collected:
            self.group.log.append(f"{self.group.role} answered")
            self.collected = True
        return self.answers


class FakeMegatron:
    """The ranks of a Megatron group, which offload `offloads` (a subset of STATE_GIB); the actor's
    sends the weights (recording what both sides hold then) and answers its side of the check."""

    def __init__(self, offloads: set[str]):
        self.offloads = offloads
        self.resident = set(STATE_GIB) - offloads  # as `offload_before_engines` leaves it
        self.engines: FakeEngines | None = None
        self.seen: dict[str, tuple[set, set]] = {}

    def offload_training_state(self) -> dict[str, float]:
        self.resident -= self.offloads & {"grads", "optimizer"}
        return self.memory_stats()

    def offload_params(self) -> dict[str, float]:
        self.resident -= self.offloads & {"params"}
        return self.memory_stats()

    def onload(self) -> dict[str, float]:
        self.resident = set(STATE_GIB)
        return self.memory_stats()

    def free_device_memory(self) -> None:
        return None

    def memory_stats(self) -> dict[str, float]:
        return {"device_used_gib": sum(STATE_GIB[part] for part in self.resident)}

    def sync_plan(self) -> str:
        return "the plan"

    def send_weights(self) -> dict[str, float]:
        self.seen["sync"] = (set(self.resident), set(self.engines.resident))
        return {}

    def weight_checksums(self, dtype: str) -> dict[str, int]:
        assert "params" in self.resident, "checksummed with the parameters off the devices"
        return {"lm_head.weight": 1}  # both ranks: 2 in all

    def probe_log_probs(self, token_ids) -> torch.Tensor:
        assert "params" in self.resident, "probed with the parameters off the devices"
        return PROBE_LOG_PROBS


class FakeEngines:
    """The rollout group: engines whose memory sleeps and wakes by vLLM's tags, and that receive a sync."""

    def __init__(self, actor: FakeMegatron):
        self.actor = actor
        self.resident = set(ENGINE_GIB)
        self.version = 0

    def sleep(self) -> dict[str, float]:
        self.resident = set()
        return self.memory_stats()

    def wake_up(self, tags: list[str]) -> dict[str, float]:
        self.resident |= set(tags)
        return self.memory_stats()

    def memory_stats(self) -> dict[str, float]:
        return {"device_used_gib": sum(ENGINE_GIB[part] for part in self.resident)}

    def checksum_loads(self, enabled: bool) -> None:
        pass

    def start_receive(self, source) -> None:
        assert "weights" in self.resident, "received into weights that are asleep"

    def finish_receive(self, timeout_s: float) -> int:
        self.version += 1
        return self.version

    def loaded_checksums(self) -> list[LoadedChecksums]:
        self.actor.seen["check"] = (set(self.actor.resident), set(self.resident))
        return [LoadedChecksums("float32", full={"lm_head.weight": 2})]

    def prompt_logprobs(self, token_ids) -> list[torch.Tensor]:
        assert self.resident == set(ENGINE_GIB), "probed before the engines were fully awake"
        return list(PROBE_LOG_PROBS)


def handover(offloads: set[str], engines_sleep: bool = True, critic_group: bool = False, verify_every: int = 1):
    """The hand-over of a colocated quickstart (actor TP 2, one engine) over fakes; the fakes' log, the
    actor's and the engines' state."""
    log = Log()
    actor = FakeMegatron(offloads)
    policy = FakeGroup("actor", log, actor, world_size=2)
    groups = {"actor": SimpleNamespace(workers=policy), "ref": SimpleNamespace(workers=policy)}
    if critic_group:
        groups["critic"] = SimpleNamespace(workers=FakeGroup("critic", log, FakeMegatron(offloads), world_size=2))
    actor.engines = engines = FakeEngines(actor)
    roles = SimpleNamespace(groups=groups, policy=policy, rollout=FakeGroup("rollout", log, engines, 1), routes=None)
    config = load_config(QUICKSTART, [f"rollout.sync.verify_every={verify_every}"])
    sync = WeightSync(roles, config, vocab_size=64, total_steps=10)
    log.clear()  # the sync plan, fetched once per run
    policy.trips = 0
    return HandOver(roles, sync, engines_sleep=engines_sleep, timer=PhaseTimer()), log, actor, engines


def trips(step: HandOver) -> int:
    """The hand-over's round trips so far, every group's."""
    return sum({id(g): g.trips for g in [*step.megatron.values(), step.rollout]}.values())


def assert_finished_before(log: Log, call: str, later: str) -> None:
    """The driver collected the answers of the round trip of `call` before it started `later`'s."""
    role = call.split(".")[0]
    answered = log.index(f"{role} answered", log.index(call))
    assert answered < log.index(later), f"{later} started before {call} finished: {log}"


def device_used(memory: dict[str, float], phase: str) -> float:
    """The GPU's use in `phase`: every role's last report up to it (a role that did not act kept its memory)."""
    order = list(MEMORY_PHASES)
    latest: dict[str, float] = {}
    for name, value in sorted(memory.items(), key=lambda item: order.index(item[0].split("/")[2])):
        _, role, at, _ = name.split("/")
        if order.index(at) <= order.index(phase):
            latest[role] = value
    return sum(latest.values())


def test_a_step_hands_over_in_verls_order_one_round_trip_per_group_and_phase():
    step, log, actor, engines = handover(offloads={"params", "grads", "optimizer"})
    step.to_training()
    assert engines.resident == set() and actor.resident == set(STATE_GIB)
    log.append("train")
    metrics = step.to_rollout(3)
    assert log == [
        "rollout.memory_stats",  # after generating
        "rollout.sleep",
        "rollout answered",
        "actor.memory_stats",  # after generating
        "actor.onload",
        "actor answered",
        "train",
        "actor.memory_stats",  # after training
        "actor.offload_training_state",
        "actor answered",
        "rollout.memory_stats",  # after training
        "rollout.wake_up(['weights'])",
        "rollout.start_receive",
        "rollout.finish_receive",
        "actor.send_weights",
        "actor.weight_checksums",
        "actor.probe_log_probs",
        "actor.offload_params",
        "rollout answered",
        "actor answered",
        "rollout.wake_up(['kv_cache'])",
        "rollout.loaded_checksums",
        "rollout.prompt_logprobs",
        "rollout answered",
    ]
    assert trips(step) == 6
    # The sync finds the actor's parameters (only) beside the engines' weights (only); the check finds
    # the engines fully awake beside nothing of the actor.
    assert actor.seen["sync"] == ({"params"}, {"weights"})
    assert actor.seen["check"] == (set(), {"weights", "kv_cache"})
    assert metrics["sync/weight_version"] == 1.0 and metrics["sync/logprob_max_abs_diff"] == 0.0
    assert metrics["sync/checksum_tensors"] == 1.0


def test_the_memory_order_holds_between_the_groups():
    """Whatever runs beside what in a phase, a GPU never holds one side's memory before the other
    side's left: the engines sleep before the Megatron state onloads, the training state leaves before
    the engines' weights wake, the parameters leave before the engines' KV cache wakes."""
    step, log, *_ = handover(offloads={"params", "grads", "optimizer"}, critic_group=True)
    step.to_training()
    step.to_rollout(1)
    for role in ("actor", "critic"):
        assert_finished_before(log, "rollout.sleep", f"{role}.onload")
        assert_finished_before(log, f"{role}.offload_training_state", "rollout.wake_up(['weights'])")
        assert_finished_before(log, f"{role}.offload_params", "rollout.wake_up(['kv_cache'])")


def test_an_unchecked_sync_hands_over_in_as_many_round_trips():
    step, log, *_ = handover(offloads={"params"}, verify_every=2)
    step.to_training(), step.to_rollout(1)  # a run's first sync: checked
    log.clear()
    step.to_training(), step.to_rollout(3)
    assert trips(step) == 12
    assert not [call for call in log if call.endswith(("checksums", "log_probs", "logprobs"))]
    assert log[-2:] == ["rollout.wake_up(['kv_cache'])", "rollout answered"]


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
    step, _, actor, _engines = handover(offloads={"optimizer"})
    step.to_training()
    step.to_rollout(1)
    assert actor.seen["sync"] == ({"params", "grads"}, {"weights"})
    assert actor.seen["check"] == ({"params", "grads"}, {"weights", "kv_cache"})
    assert step.pop_memory()["memory/actor/params_offloaded/device_used_gib"] == 3.0


def test_engines_that_never_sleep_are_left_alone():
    step, log, *_ = handover(offloads=set(), engines_sleep=False, verify_every=2)
    step.to_training()
    # Their memory is read beside the Megatron onload, no order between them.
    assert log == ["rollout.memory_stats", "actor.memory_stats", "actor.onload", "rollout answered", "actor answered"]
    step.to_rollout(1)
    assert not [call for call in log if call.startswith(("rollout.sleep", "rollout.wake_up"))]
    assert "actor.onload" in log and "actor.offload_params" in log
    log.clear()
    step.to_rollout(3)  # unchecked: nothing after the sync
    # Onload 2; the checked sync 4 (the engines checked in a trip of their own); the unchecked one 3.
    assert log[-1] == "actor answered" and trips(step) == 2 + 4 + 3


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
    assert "critic.send_weights" not in log
    assert "memory/critic/params_offloaded/device_used_gib" in step.pop_memory()
    assert trips(step) == 6 + 3  # the critic's group in the onload, the offload and the parameters' offload


def test_groups_are_named_by_the_first_role_they_host():
    policy, critic = object(), object()
    groups = {
        "actor": SimpleNamespace(workers=policy),
        "critic": SimpleNamespace(workers=critic),
        "ref": SimpleNamespace(workers=policy),
    }
    assert megatron_groups(groups) == {"actor": policy, "critic": critic}


class FakeGpuGroup(FakeGroup):
    """A Megatron group on GPUs whose fullest one has `free` of `total` GiB free after offloading."""

    def __init__(self, log: Log, free: float, total: float):
        super().__init__("actor", log, FakeMegatron(offloads=set()), world_size=2)
        self.free, self.total = free, total

    def call_all(self, method: str, *args):
        answers = super().call_all(method, *args)
        return [(self.free + 1.0, self.total), (self.free, self.total)] if method == "free_device_memory" else answers


def test_engines_start_after_the_offload_and_within_the_free_memory():
    log = Log()
    group = FakeGpuGroup(log, free=60.0, total=80.0)
    offload_before_engines([SimpleNamespace(workers=group)], gpu_memory_utilization=0.7)
    assert [call for call in log if "answered" not in call] == [
        "actor.offload_training_state",
        "actor.offload_params",
        "actor.free_device_memory",
    ]
    with pytest.raises(
        ConfigError,
        match=r"rollout.gpu_memory_utilization = 0.8: .* 64.0 GiB of each 80.0 GiB GPU.* "
        r"only 60.0 GiB is free.*use at most 0.75",
    ):
        offload_before_engines([SimpleNamespace(workers=group)], gpu_memory_utilization=0.8)


def test_on_cpu_the_engines_start_whatever_is_free():
    log = Log()
    group = FakeGroup("actor", log, FakeMegatron(set()), world_size=2)
    offload_before_engines([SimpleNamespace(workers=group)], gpu_memory_utilization=1.0)
    assert [call for call in log if "answered" not in call] == [
        "actor.offload_training_state",
        "actor.offload_params",
        "actor.free_device_memory",
    ]
