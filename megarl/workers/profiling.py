"""Torch profiler traces of chosen training steps on chosen Megatron ranks (`trainer.profile`).

    profiler = StepProfiler("actor", rank=0, cuda=uses_cuda())
    profiler.start(request)                  # with the step's first staged call; nothing unless chosen
    with profiler.phase("update_actor"):     # a `record_function` range, and an NVTX range on CUDA
        ...
    path = profiler.stop()                   # after the step's weight sync: the Chrome trace written

The driver asks for a step's profile with the batch it stages (`PolicyWorker.stage_batch`) and ends it
after the step's weight sync (`PolicyWorker.stop_profile`): one extra Ray call per group, on profiled
steps only. The trace covers the worker's side of the step: the log-prob passes, the updates, the
hand-over's offloads and the weight-sync send. The NVTX ranges (torch.cuda.nvtx.range_push/range_pop,
which emit `nvtxRangePushA` / `nvtxRangePop`) name the same phases for Nsight Systems
(`nsys profile --trace=cuda,nvtx ...`).
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from pathlib import Path

from torch.cuda import nvtx
from torch.profiler import ProfilerActivity, profile, record_function


@dataclasses.dataclass(frozen=True)
class ProfileRequest:
    """One step's profile, as the driver sends it with the step's staged batch."""

    step: int
    directory: str
    """The traces' root: each chosen rank writes `trace_path(directory, step, group, rank)`."""
    ranks: tuple[int, ...] | None
    """The ranks of each Megatron group that record (their global rank in the group); None: all."""

    def chosen(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def trace_path(directory: str | Path, step: int, group: str, rank: int) -> Path:
    """Where rank `rank` of the group named `group` (the first role it hosts) writes step `step`'s trace."""
    return Path(directory) / f"step_{step}" / f"{group}_rank{rank}.pt.trace.json"


def activities(cuda: bool) -> list[ProfilerActivity]:
    """What the profiler records: CPU ops, and the CUDA kernels on a CUDA rank."""
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]


class StepProfiler:
    """One rank's profiler of chosen steps: idle (every `phase` a no-op) unless a step is being recorded."""

    def __init__(self, group: str, *, rank: int, cuda: bool):
        """`group`: the name of the rank's group in trace file names; `rank`: the rank's in its group;
        `cuda`: whether the rank computes on CUDA."""
        self.group = group
        self.rank = rank
        self.cuda = cuda
        self.running: profile | None = None
        self.path: Path | None = None
        """The trace file of the step being recorded."""

    def start(self, request: ProfileRequest | None) -> None:
        """Record from now until `stop` when `request` names this rank (a recording already running, left
        by a step cut short, is dropped)."""
        self.running, self.path = None, None
        if request is None or not request.chosen(self.rank):
            return
        self.path = trace_path(request.directory, request.step, self.group, self.rank)
        self.running = profile(activities=activities(self.cuda))
        self.running.start()

    @contextmanager
    def phase(self, name: str):
        """A range named `name` in the trace being recorded (and in nsys's NVTX row on CUDA)."""
        if self.running is None:
            yield
            return
        if self.cuda:
            nvtx.range_push(name)
        try:
            with record_function(name):
                yield
        finally:
            if self.cuda:
                nvtx.range_pop()

    def stop(self) -> str | None:
        """End the recording and write its Chrome trace (complete or not at all: written beside, then
        renamed); its path, or None where nothing was recorded."""
        if self.running is None:
            return None
        running, path, self.running, self.path = self.running, self.path, None, None
        running.stop()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        running.export_chrome_trace(str(partial))
        os.replace(partial, path)
        return str(path)
