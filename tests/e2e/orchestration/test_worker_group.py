"""Worker groups on a real local Ray: one torch.distributed world, per-rank calls, failures named."""

import os
import signal

import psutil
import pytest
from ray.util.placement_group import remove_placement_group

from megarl.orchestration.cluster import init_ray, shutdown_ray
from megarl.orchestration.placement import BundleSpec, PlacementError, create_placement_group
from megarl.orchestration.worker_group import DEATH_GRACE_S, Call, WorkerFailure, WorkerGroup, round_trips, wait_all

TARGET = "tests.e2e.orchestration.targets:SumWorker"


@pytest.fixture(scope="module")
def ray_cluster():
    # Ray resources are logical: 4 "CPUs" on a 2-core machine is fine for these light processes.
    init_ray(num_cpus=4)
    yield
    shutdown_ray()


@pytest.fixture
def make_group(ray_cluster):
    """Builds worker groups; their processes and placement groups are released after the test."""
    made = []

    def make(name, world_size=2, **kwargs):
        pg = create_placement_group(name, world_size, BundleSpec(cpus=1))
        made.append(pg)
        group = WorkerGroup(name, TARGET, world_size, pg, BundleSpec(cpus=1), **kwargs)
        made.append(group)
        return group

    yield make
    for item in reversed(made):
        item.kill() if isinstance(item, WorkerGroup) else remove_placement_group(item)


def test_ranks_form_one_world_and_each_call_is_one_round_trip(make_group):
    group = make_group("sum", init_kwargs=[{"offset": 10}, {"offset": 20}])
    before = round_trips()
    assert group.call_all("rank") == [0, 1]
    assert group.call_all("all_reduce", 1.0) == [32.0, 32.0]
    assert group.call_each("all_reduce", [(1.0,), (2.0,)]) == [33.0, 33.0]
    assert group.call_rank0("rank") == 0
    assert round_trips() - before == 4, "one per call, however many ranks answer"
    # At the driver's priority, not at Ray's niceness 15 for workers (`cluster.WORKER_PRIORITY`).
    assert [psutil.Process(pid).nice() for pid in group.pids] == [psutil.Process().nice()] * 2


def test_a_chain_is_one_round_trip_run_in_order_and_two_groups_run_at_once(make_group):
    """A chain's calls run one after the other on each rank (the all-reduce sees the offset set before
    it); `submit` returns before the ranks answer, so a group can wait in a collective for one issued
    later; `wait_all` raises the first failure of either group, whichever it waits on first."""
    group = make_group("chained", init_kwargs=[{"offset": 1}, {"offset": 2}])
    before = round_trips()
    assert group.chain(Call("rank"), Call("all_reduce", (10.0,))) == [[0, 23.0], [1, 23.0]]
    assert round_trips() - before == 1
    other = make_group("other")
    reducing = group.submit([[Call("all_reduce", (0.0,))]] * 2)
    assert wait_all(other.submit([[Call("rank")]] * 2), reducing) == [[[0], [1]], [[3.0], [3.0]]]
    hanging = group.submit([[Call("hang")]] * 2)
    with pytest.raises(WorkerFailure, match="deliberate failure on rank 1"):
        wait_all(hanging, other.submit([[Call("fail_on", (1,))]] * 2))
    _assert_gone(other.pids)


def test_an_argument_shared_by_ranks_is_stored_once_and_unwanted_results_stay_in_the_ranks(make_group, monkeypatch):
    """`call_each` puts an argument object that several ranks get into Ray's object store once (each rank
    reads that copy: `ray.put` once, not one serialization per call), and a rank told not to reply
    returns None; the others' results arrive."""
    import megarl.orchestration.worker_group as worker_group

    puts = []
    real_put = worker_group.ray.put
    monkeypatch.setattr(worker_group.ray, "put", lambda value: puts.append(value) or real_put(value))
    group = make_group("shared")
    shared = list(range(100_000))  # a batch-sized argument (Ray would store it anew per call)
    assert group.call_each("checksum", [(shared,), (shared,)], replying=[True, False]) == [sum(shared), None]
    assert len(puts) == 1 and puts[0] is shared
    puts.clear()
    assert group.call_each("checksum", [([1, 2],), ([3],)]) == [3.0, 1003.0]  # nothing shared: passed by value
    assert puts == []


def test_remote_exception_names_role_rank_and_traceback(make_group):
    group = make_group("failing")
    with pytest.raises(
        WorkerFailure, match=r"failing rank 1 failed:(.|\n)*ValueError: deliberate failure on rank 1"
    ) as info:
        group.call_all("fail_on", 1)
    assert (info.value.role, info.value.rank) == ("failing", 1)
    _assert_gone(group.pids)


def test_dead_rank_ends_the_call(make_group):
    group = make_group("dying")
    with pytest.raises(WorkerFailure, match=r"dying rank 0 failed"):
        group.call_all("die_on", 0)
    _assert_gone(group.pids)


def test_unanswered_call_times_out(make_group):
    group = make_group("hanging", world_size=1)
    group.call_timeout_s = 5  # after the start-up, which on a loaded host alone may take longer
    with pytest.raises(WorkerFailure, match=r"did not answer within the call timeout"):
        group.call_all("hang")
    _assert_gone(group.pids)


def test_stopped_rank_is_named_by_its_silent_heartbeat(make_group):
    """Rank 1 alive but stopped: rank 0 waits in the all-reduce for it and no error ever comes; the
    heartbeat names rank 1, its process and node, and the group's processes (the stopped one too) go."""
    group = make_group("stopping", hang_timeout_s=3)
    os.kill(group.pids[1], signal.SIGSTOP)
    try:
        with pytest.raises(
            WorkerFailure,
            match=r"stopping rank 1 failed:\n\(process \d+ on node [\d.]+\) ranks \[1\] "
            r"are alive but not running .*no heartbeat for 3 s",
        ) as info:
            group.call_all("all_reduce", 1.0)
        assert (info.value.pid, info.value.node) == (group.pids[1], group.nodes[1])
        _assert_gone(group.pids)
    finally:
        _continue(group.pids[1])


def test_a_peers_collective_timeout_defers_to_the_stopped_rank(make_group):
    """The collective times out (1 s) long before the hang timeout: rank 0's error comes first, but the
    rank it was waiting for, silent meanwhile, is the one named."""
    group = make_group("timing-out", collective_timeout_s=1)
    os.kill(group.pids[1], signal.SIGSTOP)
    try:
        with pytest.raises(
            WorkerFailure,
            match=r"timing-out rank 1 failed:(.|\n)*ranks \[1\] are alive but not running "
            r"(.|\n)*while timing-out rank 0's call failed(.|\n)*",
        ) as info:
            group.call_all("all_reduce", 1.0)
        assert info.value.pid == group.pids[1]
        _assert_gone(group.pids)
    finally:
        _continue(group.pids[1])


def test_a_silent_rank_of_a_peer_group_ends_a_wait_on_this_one(make_group):
    """The sending side of a weight sync (alive, beating, blocked until its collective times out) while an
    engine rank is cut off: the peer's silent rank is named, with its process and node, not the waiting rank."""
    waiting = make_group("sending", world_size=1)
    peer = make_group("receiving", hang_timeout_s=3)
    waiting.shares_collectives_with(peer)
    os.kill(peer.pids[1], signal.SIGSTOP)
    try:
        with pytest.raises(
            WorkerFailure,
            match=r"receiving rank 1 failed:\n\(process \d+ on node [\d.]+\) ranks \[1\] are alive but not running "
            r".*no heartbeat for 3 s \(the hang timeout\) while sending ranks \[0\] waited",
        ) as info:
            waiting.call_all("hang")
        assert (info.value.role, info.value.pid, info.value.node) == ("receiving", peer.pids[1], peer.nodes[1])
        _assert_gone(waiting.pids)
    finally:
        _continue(peer.pids[1])


def test_an_error_defers_to_a_rank_of_a_peer_group_that_died(make_group):
    """The weight sync's race: a trainer rank dies while sending, and the engine whose receive broke answers
    first (here at once, the sender dying a moment later): the dead sender is named, not the engine."""
    receiving = make_group("receiving", world_size=1)
    sending = make_group("sending", world_size=1)
    receiving.shares_collectives_with(sending)
    sending.shares_collectives_with(receiving)
    send = sending.submit([[Call("die_after", (DEATH_GRACE_S / 4,))]])
    receive = receiving.submit([[Call("fail_on", (0,))]])
    with pytest.raises(WorkerFailure, match=r"sending rank 0 failed:\n\(process \d+ on node [\d.]+\) ") as info:
        wait_all(receive, send)
    assert (info.value.role, info.value.pid) == ("sending", sending.pids[0])
    _assert_gone(receiving.pids + sending.pids)


def test_shutdown_runs_each_ranks_clean_up_then_ends_them_a_busy_one_at_the_deadline(make_group, tmp_path):
    group = make_group("closing", init_kwargs={"shutdown_marker": str(tmp_path / "clean")})
    group.submit([[], [Call("hang")]])  # rank 1 busy: its clean-up call waits behind the hang
    group.shutdown(timeout_s=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean.0"]
    _assert_gone(group.pids)


def _continue(pid):
    """A stopped process the test left behind would hold its Ray worker slot: let it run (and die)."""
    process = _proc(pid)
    if process is not None:
        process.resume()


def test_unsatisfiable_placement_is_a_clear_error(ray_cluster):
    with pytest.raises(PlacementError, match=r"needs 64 processes × \(1 CPU, 0 GPU\).*cluster has 4 CPU, 0 GPU"):
        create_placement_group("too-big", 64, BundleSpec(cpus=1), timeout_s=2)


def _assert_gone(pids):
    """Killed ranks leave no process behind (bounded wait on the condition)."""
    _gone, alive = psutil.wait_procs([p for p in map(_proc, pids) if p], timeout=30)
    assert not alive, f"rank processes still alive: {alive}"


def _proc(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
