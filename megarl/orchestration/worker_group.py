"""A group of Ray actor processes that form one torch.distributed world and host a plain worker class.

Usage:
    group = WorkerGroup("actor", "megarl.trainer.rank_worker:RankWorker", world_size=2,
                        placement=pg, bundle=BundleSpec(cpus=1), init_kwargs={...})
    group.call_all("compute_log_prob", batch)          # same arguments on every rank -> [r0, r1]
    group.call_each("generate", [args_r0, args_r1])     # one argument tuple per rank
    group.call_rank0("export_hf", out_dir)
    group.chain(Call("memory_stats"), Call("onload"))   # several calls, one round trip -> [[m0, o0], [m1, o1]]
    sending = group.submit([[Call("send_weights")]] * 2)   # in flight; other groups' calls can start
    wait_all(receiving, sending)                         # the results of both, the first failure raised

Arguments reach the ranks through Ray's object store: an argument object given to several ranks is
stored once and every one of them reads that copy (passed by value, Ray would serialize it once per
call: a batch, TP × PP times per DP replica). A rank can be told not to reply (`replying`): it drops
its result instead of sending back a copy that the caller would throw away.

Every call (`call_all`, `call_each`, `call_rank0`, `chain`, `submit`) is one driver round trip: the driver
sends to the group and waits for its ranks' answers. `round_trips()` counts them in this process, so the
loop can log how many a step took (`perf/round_trips`). A round trip can carry a chain of calls (`Call`s)
that each rank runs in order, one after the other, in one Ray task: the driver's phases that need no
answer between two calls of a group make them one trip. `submit` returns at once, so that calls to two
groups that must run at the same time (a sender and its receivers) are in flight together;
`PendingCall.wait` or `wait_all` collect them.

Rank 0 starts first and tells the others where to rendezvous. A failure on any rank raises
`WorkerFailure` naming the role, the rank, its process and node, and the remote traceback, and kills the
whole group, so peers blocked in a collective with the dead rank do not hang the driver. A rank that is
alive but does not run (stopped, frozen, cut off) is found by its heartbeat (`megarl.orchestration.heartbeat`):
silent for `hang_timeout_s`, it fails the call the same way. So is a silent rank of a group whose ranks share
collectives with this one's (`shares_collectives_with`: the trainer and the engines in the weight sync): a
trainer rank sending to an engine on a node that was cut off is alive and beating, and would otherwise wait
for its collective's own timeout and then be blamed for it.
"""

import importlib
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl import interrupt, quiet
from megarl.orchestration.heartbeat import Heartbeat, HeartbeatWatch
from megarl.orchestration.placement import BundleSpec

DEFAULT_CALL_TIMEOUT_S = 1800.0
DEFAULT_HANG_TIMEOUT_S = 600.0
DEATH_GRACE_S = 5.0
"""How long a rank's error waits for news that a peer's process died or stopped running (the likelier root
cause; several heartbeats, `heartbeat.BEAT_S`)."""


_calls_lock = threading.Lock()
_calls_made = 0


def round_trips() -> int:
    """Driver round trips (calls to a group, answered by its ranks) this process made so far, from any
    thread (an async run's generation thread included)."""
    return _calls_made


def _count_round_trip() -> None:
    global _calls_made
    with _calls_lock:
        _calls_made += 1


@dataclass(frozen=True)
class Call:
    """One method call of a rank's worker: `method(*args)`; a step of a chain (`WorkerGroup.chain`, `submit`)."""

    method: str
    args: tuple = ()


class WorkerFailure(RuntimeError):
    """A rank of a worker group raised, died, or did not answer in time."""

    def __init__(self, role: str, rank: int, detail: str, pid: int | None = None, node: str | None = None):
        where = "" if pid is None else f"(process {pid} on node {node}) "
        super().__init__(f"{role} rank {rank} failed:\n{where}{detail}")
        self.role = role
        self.rank = rank
        self.pid = pid
        """The rank's process id, once the group has started (None during start-up)."""
        self.node = node
        """The IP address of the rank's node, with `pid`."""


class RankProcess:
    """The Ray actor body: one rank process that joins its group's world and hosts a worker object."""

    def __init__(self, role: str, rank: int, world_size: int, env: dict[str, str], heartbeat_key: str):
        Heartbeat(heartbeat_key).start()
        os.environ.update(env)
        quiet.install()  # after the environment: it holds the device decision
        self.role, self.rank, self.world_size = role, rank, world_size
        self.target = None
        self.store = None
        """Rank 0: the rendezvous store it serves, from `rendezvous_address` until `start`."""

    def rendezvous_address(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: open the group's rendezvous store on this node's address (127.0.0.1 on a local
        Ray instance), on a port the OS picks; where the other ranks should connect."""
        from megarl.parallel.distributed import listen_store

        host = ray.util.get_node_ip_address()
        self.store = listen_store(host, self.world_size, timeout_s)
        return host, self.store.port

    def start(self, master_addr: str, master_port: int, target: str, kwargs: dict, timeout_s: float) -> tuple[int, str]:
        """Join the world and build the worker; this process's id and its node's IP address."""
        import torch

        from megarl.parallel.device import uses_cuda
        from megarl.parallel.distributed import init_distributed

        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.device_index()),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        if not uses_cuda():
            # Ray sets OMP_NUM_THREADS=1 for actors; use the cores this bundle reserved.
            torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        init_distributed(timeout_s=timeout_s, store=self.store, cuda=uses_cuda() and bool(ray.get_gpu_ids()))
        module_name, class_name = target.split(":")
        self.target = getattr(importlib.import_module(module_name), class_name)(**kwargs)
        return os.getpid(), ray.util.get_node_ip_address()

    @staticmethod
    def device_index() -> int:
        """The CUDA ordinal of this rank's GPU (0 without one). Ray sets CUDA_VISIBLE_DEVICES of an actor
        with GPUs to its assigned ids (ray/_private/utils.py: set_visible_accelerator_ids ->
        NvidiaGPUAcceleratorManager.set_current_process_visible_accelerator_ids, skipped when
        RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is set), so the ordinal is the id's position there."""
        from megarl.parallel.device import visible_index

        gpu_ids = ray.get_gpu_ids()
        return visible_index(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES")) if gpu_ids else 0

    def run(self, layout: list[tuple[str, int]], *args: Any) -> list[Any]:
        """Run a chain of calls in order: `layout[i]` is the i-th call's method and how many of `args`
        (the chain's arguments, in order) are its own (`WorkerGroup.submit`). Each call's result."""
        results, start = [], 0
        for method, count in layout:
            results.append(getattr(self.target, method)(*args[start : start + count]))
            start += count
        return results

    def run_dropping_results(self, layout: list[tuple[str, int]], *args: Any) -> None:
        """`run`, for a rank whose results the caller does not need: nothing travels back."""
        self.run(layout, *args)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def stored_once(per_rank_args: Sequence[Sequence]) -> list[tuple]:
    """`per_rank_args` with each argument object that several ranks get (the same object) replaced by
    one `ray.put` of it: Ray hands a rank the stored value of an `ObjectRef` argument, and stores an
    argument passed by value anew for every call."""
    counts: dict[int, int] = {}
    for args in per_rank_args:
        for arg in args:
            counts[id(arg)] = counts.get(id(arg), 0) + 1
    refs: dict[int, ray.ObjectRef] = {}
    for args in per_rank_args:
        for arg in args:
            if counts[id(arg)] > 1 and id(arg) not in refs:
                refs[id(arg)] = ray.put(arg)
    return [tuple(refs.get(id(arg), arg) for arg in args) for args in per_rank_args]


class WorkerGroup:
    """`world_size` RankProcess actors hosting `target` ("pkg.mod:Class"): rank r on placement-group bundle
    `bundles[r]` (default r; a run's groups pass their slots' bundles, `placement.gpu_slots`; a rollout
    engine's rank sits on the first bundle of its TP group, its TP workers on the others). `init_kwargs`
    and `env`: one for all ranks, or a list with one per rank."""

    def __init__(
        self,
        role: str,
        target: str,
        world_size: int,
        placement,
        bundle: BundleSpec,
        init_kwargs: dict | list[dict] | None = None,
        env: dict[str, str] | list[dict[str, str]] | None = None,
        collective_timeout_s: float = 600.0,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        bundles: Sequence[int] | None = None,
    ):
        self.role = role
        self.world_size = world_size
        self.call_timeout_s = call_timeout_s
        self.pids: list[int] = []
        """Process id of each rank, once started."""
        self.nodes: list[str] = []
        """IP address of each rank's node, once started."""
        keys = [f"{role}-{uuid.uuid4().hex}/{rank}" for rank in range(world_size)]
        self.heartbeats = HeartbeatWatch(keys, hang_timeout_s)
        self.peers: list[WorkerGroup] = []
        """Groups whose ranks join collectives with this group's (`shares_collectives_with`)."""
        per_rank = init_kwargs if isinstance(init_kwargs, list) else [dict(init_kwargs or {})] * world_size
        per_rank_env = env if isinstance(env, list) else [dict(env or {})] * world_size
        bundles = list(range(world_size)) if bundles is None else list(bundles)
        assert len(bundles) == world_size, "one bundle per rank"
        self.actors = self._create_actors(placement, bundle, bundles, per_rank_env, keys)
        rendezvous = self.actors[0].rendezvous_address.remote(collective_timeout_s)
        host, port = self._wait([rendezvous], timeout_s=call_timeout_s)[0]
        started = self._wait(
            [a.start.remote(host, port, target, per_rank[r], collective_timeout_s) for r, a in enumerate(self.actors)],
            timeout_s=call_timeout_s,
        )
        self.pids, self.nodes = [pid for pid, _ in started], [node for _, node in started]

    def _create_actors(
        self, placement, bundle: BundleSpec, bundles: list[int], env: list[dict[str, str]], heartbeat_keys: list[str]
    ) -> list:
        remote_cls = ray.remote(RankProcess)
        return [
            remote_cls.options(
                num_cpus=bundle.cpus,
                num_gpus=bundle.gpus,
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement, placement_group_bundle_index=bundles[rank]
                ),
            ).remote(self.role, rank, self.world_size, env[rank], heartbeat_keys[rank])
            for rank in range(self.world_size)
        ]

    def shares_collectives_with(self, *groups: "WorkerGroup") -> None:
        """Ranks of `groups` join collectives with this group's ranks: a wait on this group also fails, naming
        the peer's rank and node, when a rank of theirs is silent for their hang timeout."""
        self.peers = list(groups)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` with the same arguments on every rank; results in rank order."""
        return [results[0] for results in self.chain(Call(method, args))]

    def call_each(
        self, method: str, per_rank_args: list[tuple], *, replying: Sequence[bool] | None = None
    ) -> list[Any]:
        """Call `method(*per_rank_args[r])` on rank r (e.g. each rank's DP slice); results in rank order. An
        argument object given to several ranks is stored once (`stored_once`). `replying[r]` False: rank
        r's result is dropped in the rank, None here."""
        assert len(per_rank_args) == self.world_size, "one argument tuple per rank"
        chains = self.submit([[Call(method, args)] for args in per_rank_args], replying=replying).wait()
        return [None if results is None else results[0] for results in chains]

    def call_rank0(self, method: str, *args: Any) -> Any:
        """Call `method` on rank 0 only (e.g. exports that need no collective)."""
        _count_round_trip()
        layout, flat = _flatten([Call(method, args)])
        return PendingCall(self, [self.actors[0].run.remote(layout, *flat)]).wait()[0][0]

    def chain(self, *calls: Call) -> list[list[Any]]:
        """Run `calls` in order on every rank, in one round trip; per rank (in rank order) each call's result."""
        return self.submit([list(calls)] * self.world_size).wait()

    def submit(self, per_rank_calls: list[list[Call]], *, replying: Sequence[bool] | None = None) -> "PendingCall":
        """Start rank r on the chain `per_rank_calls[r]` (its calls in order) and return at once: one round
        trip, collected by `PendingCall.wait` (or `wait_all`, with other groups' calls). An argument
        object given to several ranks is stored once (`stored_once`). `replying[r]` False: rank r's
        results are dropped in the rank, None for it."""
        assert len(per_rank_calls) == self.world_size, "one chain of calls per rank"
        replying = [True] * self.world_size if replying is None else list(replying)
        _count_round_trip()
        flattened = [_flatten(calls) for calls in per_rank_calls]
        shared = stored_once([flat for _, flat in flattened])
        refs = []
        for actor, (layout, _), args, reply in zip(self.actors, flattened, shared, replying, strict=True):
            run = actor.run if reply else actor.run_dropping_results
            refs.append(run.remote(layout, *args))
        return PendingCall(self, refs)

    def node_ids(self) -> list[str]:
        """The Ray node of each rank, in rank order."""
        return self._wait([a.node_id.remote() for a in self.actors])

    def shutdown(self, timeout_s: float) -> None:
        """Let every rank's worker release what lives outside its process (`shutdown()` of the hosted
        object: a rollout engine stops its worker processes, which unlink their shared memory), then
        `kill` the ranks. `kill` alone ends a rank at once, without its clean-up, and Ray then kills
        its child processes too, so those leave their /dev/shm segments and semaphores behind. A rank
        that fails, or is still busy or shutting down when `timeout_s` (for the whole group) runs
        out, is killed all the same."""
        calls = [actor.run.remote(*_flatten([Call("shutdown")])) for actor in self.actors]
        ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        """Stop every rank process of the group (idempotent)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.heartbeats.forget()

    def _wait(self, refs: list, timeout_s: float | None = None) -> list[Any]:
        """Gather results in order; on the first failure or at the deadline, kill the group and raise."""
        return PendingCall(self, refs, timeout_s).wait()

    def _fail(self, rank: int, detail: str, culprit: "WorkerGroup | None" = None):
        """Kill this group and raise `WorkerFailure` for `culprit`'s (default this group's) `rank`."""
        self.kill()
        culprit = culprit or self
        raise WorkerFailure(culprit.role, rank, detail, *culprit._where(rank)) from None

    def _fail_on_silent_peer(self, waiting: list[int]) -> None:
        """Raise `WorkerFailure` for the first silent rank of a peer group (killing this group: its ranks may
        be blocked in a collective with it); nothing if all peers beat."""
        for peer in self.peers:
            stuck = peer.heartbeats.silent(list(range(peer.world_size)))
            if stuck:
                detail = (
                    f"{peer._silence(stuck)} for {peer.heartbeats.timeout_s:g} s (the hang timeout) while "
                    f"{self.role} ranks {waiting} waited, likely in a collective with them"
                )
                self._fail(stuck[0], detail, peer)

    def _root_cause(self, rank_of: dict, rank: int, error: Exception, pending: list) -> tuple["WorkerGroup", int, str]:
        """The group and rank to blame, and why. A rank whose process died or stopped running makes the ranks
        it shares collectives with fail in their next one (connection reset, timed out): its own group's
        and a peer group's alike (an engine's receive breaks when a trainer rank dies in the weight sync),
        and their errors can reach the driver first. So a raised error defers, for a moment, to a suspect
        whose process died, or whose heartbeat did not move in that moment; the suspects are this call's
        pending ranks and every rank of a peer group (asked whether its process lives: a busy rank answers
        only after its call, a dead one at once)."""
        if isinstance(error, RayActorError):
            return self, rank, str(error)
        suspects = {ref: (self, rank_of[ref]) for ref in pending}
        for peer in self.peers:
            suspects |= {actor.node_id.remote(): (peer, r) for r, actor in enumerate(peer.actors)}
        if not suspects:
            return self, rank, str(error)
        before = {ref: group.heartbeats.read([r])[r] for ref, (group, r) in suspects.items()}
        done, still_pending = ray.wait(list(suspects), num_returns=len(suspects), timeout=DEATH_GRACE_S)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except RayActorError as death:
                return *suspects[ref], str(death)
            except (RayTaskError, GetTimeoutError):
                continue
        # Still pending, the whole grace has passed: several beats of a running process.
        for ref in still_pending:
            group, r = suspects[ref]
            count = group.heartbeats.read([r])[r]
            if count is not None and count == before[ref]:
                waited = f"while {self.role} rank {rank}'s call failed, likely waiting for it"
                return group, r, f"{group._silence([r])} {waited}:\n{error}"
        return self, rank, str(error)

    @staticmethod
    def _silence(ranks: list[int]) -> str:
        return f"ranks {ranks} are alive but not running (stopped, frozen, or cut off from the cluster): no heartbeat"

    def _where(self, rank: int) -> tuple[int | None, str | None]:
        return (self.pids[rank], self.nodes[rank]) if self.pids else (None, None)


class PendingCall:
    """A group's call in flight (`WorkerGroup.submit`): its ranks' results once all answered. The first
    failure, a silent rank (its own or a peer group's: `shares_collectives_with`) or the call timeout
    kills the group and raises `WorkerFailure`."""

    def __init__(self, group: WorkerGroup, refs: list, timeout_s: float | None = None):
        """`refs`: rank r's at index r (rank 0's alone for a call of rank 0)."""
        self.group = group
        self.refs = refs
        self.deadline = time.monotonic() + (timeout_s or group.call_timeout_s)
        self.rank_of = {ref: rank for rank, ref in enumerate(refs)}
        self.pending = list(refs)
        self.results: dict = {}

    def poll(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for one more rank's answer (raising its failure); whether all answered."""
        if not self.pending:
            return True
        group, remaining = self.group, self.deadline - time.monotonic()
        done, self.pending = ray.wait(self.pending, num_returns=1, timeout=max(0.0, min(remaining, timeout_s)))
        interrupt.check()  # a stop signal: the caller's clean-up kills the groups
        if not done:
            missing = sorted(self.rank_of[r] for r in self.pending)
            stuck = group.heartbeats.silent(missing)
            if stuck:
                group._fail(
                    stuck[0], f"{group._silence(stuck)} for {group.heartbeats.timeout_s:g} s (the hang timeout)"
                )
            group._fail_on_silent_peer(missing)
            if remaining > timeout_s:
                return False
            group._fail(missing[0], f"ranks {missing} did not answer within the call timeout")
        ref = done[0]
        try:
            self.results[ref] = ray.get(ref, timeout=0)
        except (RayTaskError, RayActorError, GetTimeoutError) as error:
            culprit, rank, detail = group._root_cause(self.rank_of, self.rank_of[ref], error, self.pending)
            group._fail(rank, detail, culprit)
        return not self.pending

    def wait(self) -> list[Any]:
        """Every rank's result, in rank order."""
        while not self.poll(interrupt.POLL_S):
            pass
        return [self.results[ref] for ref in self.refs]


def wait_all(*calls: PendingCall) -> list[list[Any]]:
    """The results of calls to several groups that run at the same time, each `PendingCall.wait`'s; they
    are waited on together, so the first failure in any of them raises at once (a sender that failed
    while its receivers wait for it, or the other way round)."""
    answered = [False]
    while not all(answered):
        answered = [call.poll(interrupt.POLL_S / len(calls)) for call in calls]  # each call polled every round
    return [call.wait() for call in calls]


def _flatten(calls: Sequence[Call]) -> tuple[list[tuple[str, int]], list[Any]]:
    """A chain as `RankProcess.run` takes it: each call's method and argument count, and the arguments in order."""
    return [(call.method, len(call.args)) for call in calls], [arg for call in calls for arg in call.args]
