"""A pool of isolated tool workers (`megarl.tools.worker`): each imports every tool once and runs one
call at a time; the calls of one `run` all go out at once, each to its own worker.

The pool grows to as many workers as a `run` has calls (at most `max_workers`; more calls wait for
a free worker) and keeps them for the next `run`. A call past its time limit gets its worker's
whole process group killed and a fresh worker in its place; a call that kills its worker reads as
"raised". Nothing a tool does ends the run.
"""

from __future__ import annotations

import json
import time
from collections import deque
from multiprocessing.connection import wait

from megarl.isolation import IsolatedProcess, WorkerStartError
from megarl.tools.calls import ToolError, ToolResult

ToolJob = tuple[int, dict, float]
"""One call for the pool: (tool index, keyword arguments, time limit in seconds)."""


class ToolPool:
    def __init__(self, paths: list[str], *, max_workers: int, startup_timeout_s: float):
        """paths: the tools' `pkg.module:function`, in config order; max_workers: the most calls that run
        at once; startup_timeout_s: limit for a worker to import the tools (past it: ToolError)."""
        self._paths_json = json.dumps(paths)
        self.max_workers = max_workers
        self.startup_timeout_s = startup_timeout_s
        self.workers = [self._start(read_schemas=True)]
        self._reports: list[dict] | None = None

    def _start(self, read_schemas: bool = False) -> IsolatedProcess:
        return IsolatedProcess("megarl.tools.worker", self._paths_json, "schemas" if read_schemas else "no-schemas")

    def first_ready(self) -> list[dict]:
        """What the first worker reports once it imported the tools: per tool {"schema", "error"}."""
        if self._reports is None:
            self._reports = self._wait_ready(self.workers[0])
        return self._reports

    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self.workers]

    def _wait_ready(self, worker: IsolatedProcess) -> list[dict] | None:
        if worker.ready:
            return None
        try:
            return worker.receive_ready(self.startup_timeout_s)
        except WorkerStartError as error:
            raise ToolError(f"rollout.multi_turn.tools: the tool worker {error}") from None

    def run(self, jobs: list[ToolJob]) -> list[ToolResult]:
        """One result per job, in order; the jobs run concurrently, up to `max_workers` at a time."""
        while len(self.workers) < min(len(jobs), self.max_workers):
            self.workers.append(self._start())  # they import side by side; awaited when first used
        results: list[ToolResult | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        busy: dict[int, tuple[int, float, float]] = {}  # worker index -> (job, start, deadline)
        try:
            while pending or busy:
                for index in range(len(self.workers)):
                    if pending and index not in busy:
                        busy[index] = self._dispatch(index, pending.popleft(), jobs)
                self._collect(busy, jobs, results)
        finally:
            for index in busy:  # left mid-call by an error: their replies must not reach the next run
                self._replace(index)
        return results

    def _dispatch(self, index: int, job: int, jobs: list[ToolJob]) -> tuple[int, float, float]:
        if self.workers[index].exited():  # died while idle (e.g. the OOM killer)
            self._replace(index)
        worker = self.workers[index]
        self._wait_ready(worker)
        tool, arguments, timeout_s = jobs[job]
        worker.connection.send((tool, arguments))
        start = time.monotonic()
        return job, start, start + timeout_s

    def _collect(self, busy: dict[int, tuple[int, float, float]], jobs: list[ToolJob],
                 results: list[ToolResult | None]) -> None:
        """Wait for the first reply or deadline among busy workers; record results, replace failed workers."""
        earliest = min(deadline for _, _, deadline in busy.values())
        ready = wait([self.workers[index].connection for index in busy], timeout=max(0.0, earliest - time.monotonic()))
        now = time.monotonic()
        for index, (job, start, deadline) in list(busy.items()):
            worker = self.workers[index]
            if worker.connection in ready:
                del busy[index]
                try:
                    status, text = worker.connection.recv()
                except EOFError:  # the tool killed its worker (os._exit, a crash in C code)
                    status, text = "raised", f"the tool's process exited with code {worker.kill()}"
                    self._replace(index)
                results[job] = ToolResult(text, None, now - start) if status == "ok" else \
                    ToolResult.failed(status, f"Error: {text}", now - start)
            elif now >= deadline:
                del busy[index]
                self._replace(index)
                results[job] = ToolResult.failed(
                    "timeout", f"Error: the tool ran longer than {jobs[job][2]:g} s and was stopped", now - start)

    def _replace(self, index: int) -> None:
        self.workers[index].kill()
        self.workers[index] = self._start()

    def close(self) -> None:
        """Stop all workers (politely, then by SIGKILL)."""
        for worker in self.workers:
            worker.stop(timeout_s=5.0)
        self.workers = []
