"""The driver's reading of rank heartbeats: a rank is stuck once its counter has not moved for the
timeout, judged only after its first beat (the counters themselves: tests/e2e/orchestration/test_worker_group.py)."""

from megarl.orchestration.heartbeat import HeartbeatWatch


class ScriptedWatch(HeartbeatWatch):
    """The counters each `read` returns, by rank, instead of the cluster's key-value store."""

    def __init__(self, counts: dict[int, list[bytes | None]], timeout_s: float, times: list[float]):
        ticks = iter(times)
        super().__init__([f"g/{rank}" for rank in counts], timeout_s, clock=lambda: next(ticks))
        self.counts = {rank: iter(values) for rank, values in counts.items()}

    def read(self, ranks):
        return {rank: next(self.counts[rank]) for rank in ranks}


def test_a_rank_is_stuck_once_its_beat_has_not_moved_for_the_timeout():
    watch = ScriptedWatch({0: [b"1", b"2", b"3", b"4"], 1: [b"1", b"2", b"2", b"2"]}, 10, [0, 5, 14.9, 15])
    assert [watch.silent([0, 1]) for _ in range(4)] == [[], [], [], [1]]


def test_a_rank_that_never_beat_is_not_judged_and_a_beat_restarts_the_clock():
    watch = ScriptedWatch({0: [None, None, b"1", b"1", b"2", b"2"]}, 10, [0, 100, 100, 109, 111, 120])
    assert [watch.silent([0]) for _ in range(6)] == [[], [], [], [], [], []]
