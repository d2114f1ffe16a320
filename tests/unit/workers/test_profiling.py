"""`StepProfiler`: a chosen rank writes a Chrome trace of the profiled step with a range per phase;
other ranks and other steps write nothing; on CUDA each phase is also an NVTX range.

No CUDA here: the NVTX calls are checked against a stand-in of `torch.cuda.nvtx` with its contract
(torch/cuda/nvtx.py: `range_push(msg)` opens a nested range, `range_pop()` closes the innermost one;
they call `nvtxRangePushA` / `nvtxRangePop`, which nsys shows as NVTX ranges)."""

import json

import pytest
import torch
from torch.profiler import ProfilerActivity

from megarl.workers import profiling
from megarl.workers.profiling import ProfileRequest, StepProfiler, trace_path

pytestmark = pytest.mark.unit


def event_names(path) -> set[str]:
    return {event.get("name") for event in json.loads(open(path).read())["traceEvents"]}


def test_a_chosen_rank_writes_a_readable_trace_with_a_range_per_phase(tmp_path):
    profiler = StepProfiler("critic", rank=1, cuda=False)
    profiler.start(ProfileRequest(3, str(tmp_path), ranks=(1,)))
    with profiler.phase("compute_values"):
        torch.ones(8, 8) @ torch.ones(8, 8)
    with profiler.phase("update_critic"):
        torch.ones(4).sum()
    path = profiler.stop()
    assert path == str(trace_path(tmp_path, 3, "critic", 1)) == str(tmp_path / "step_3" / "critic_rank1.pt.trace.json")
    names = event_names(path)
    assert {"compute_values", "update_critic", "aten::matmul"} <= names
    assert [p.name for p in (tmp_path / "step_3").iterdir()] == ["critic_rank1.pt.trace.json"]  # no partial file left
    assert profiler.stop() is None  # the recording ended with the step


@pytest.mark.parametrize(
    "request_", [None, ProfileRequest(3, "unused", ranks=(1,))], ids=["step-not-profiled", "rank-not-chosen"]
)
def test_other_steps_and_ranks_record_nothing(tmp_path, request_):
    if request_ is not None:
        request_ = ProfileRequest(3, str(tmp_path), request_.ranks)
    profiler = StepProfiler("actor", rank=0, cuda=False)
    profiler.start(request_)
    with profiler.phase("update_actor"):
        torch.ones(4).sum()
    assert profiler.stop() is None
    assert list(tmp_path.iterdir()) == []


def test_all_ranks_are_chosen_without_a_rank_list():
    request = ProfileRequest(1, "d", ranks=None)
    assert all(request.chosen(rank) for rank in range(8))
    assert [rank for rank in range(4) if ProfileRequest(1, "d", ranks=(0, 2)).chosen(rank)] == [0, 2]


class NvtxStandIn:
    """torch.cuda.nvtx's range_push / range_pop: a stack of open ranges (range_push returns the depth)."""

    def __init__(self):
        self.calls, self.open = [], []

    def range_push(self, msg: str) -> int:
        self.calls.append(("push", msg))
        self.open.append(msg)
        return len(self.open) - 1

    def range_pop(self) -> int:
        self.calls.append(("pop", self.open.pop()))
        return len(self.open)


def test_on_cuda_each_phase_is_an_nvtx_range_closed_even_when_it_fails(tmp_path, monkeypatch):
    nvtx = NvtxStandIn()
    monkeypatch.setattr(profiling, "nvtx", nvtx)
    monkeypatch.setattr(profiling, "activities", lambda cuda: [ProfilerActivity.CPU])  # no CUDA to record here
    profiler = StepProfiler("actor", rank=0, cuda=True)
    with profiler.phase("update_actor"):  # not profiling: no range
        pass
    assert nvtx.calls == []
    profiler.start(ProfileRequest(2, str(tmp_path), ranks=(0,)))
    with profiler.phase("compute_log_prob"):
        pass
    with pytest.raises(RuntimeError), profiler.phase("send_weights"):
        raise RuntimeError("a failed send")
    assert nvtx.calls == [
        ("push", "compute_log_prob"),
        ("pop", "compute_log_prob"),
        ("push", "send_weights"),
        ("pop", "send_weights"),
    ]
    assert nvtx.open == []
    assert {"compute_log_prob", "send_weights"} <= event_names(profiler.stop())


def test_cpu_ranks_record_cpu_activity_and_cuda_ranks_their_kernels_too():
    assert profiling.activities(False) == [ProfilerActivity.CPU]
    assert profiling.activities(True) == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
