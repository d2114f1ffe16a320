"""A pool of isolated tool workers (`megarl.tools.worker`): each imports every tool once and runs one
call at a time; a call goes out as soon as a worker is free, each under its own time limit.

    futures = pool.submit([(tool_index, arguments, timeout_s), ...])   # returns at once
    futures[0].result()                                                 # ToolResult

One thread of the pool (started by the first `submit`) hands calls to workers and sets each call's
future as its reply or its deadline comes, so a caller may go on with the calls that are back while
slow ones run. The pool grows to as many workers as calls are in flight (at most `max_workers`;
more calls wait for a free worker) and keeps them. A call past its time limit gets its worker's
whole process group killed and a fresh worker in its place; a call that kills its worker reads as
"raised". Nothing a tool does ends the run; a worker that cannot start (ToolError) fails every
call in flight and every later one with that error.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing import Pipe
from multiprocessing.connection import wait

from megarl.isolation import IsolatedProcess, WorkerStartError
from megarl.tools.calls import ToolError, ToolResult

ToolJob = tuple[int, dict, float]
"""One call for the pool: (tool index, keyword arguments, time limit in seconds)."""

MAX_WORKERS = 32
"""Default for the most tool calls that run at once. Each worker is a whole Python process holding
every tool (tens of MB, and a CPU when busy) beside the rollout engines; 32 covers one turn's calls of
a typical step's batch (e.g. 8 prompts × 4 samples) on a node without starving the engines, and more
calls only queue. No setting reads it: a recipe with many more samples per step still runs, its
calls a few at a time."""


class ToolPool:
    def __init__(
        self, paths: list[str], *, max_workers: int, startup_timeout_s: float, env: dict[str, str] | None = None
    ):
        """paths: the tools' `pkg.module:function`, in config order; max_workers: the most calls that run
        at once; startup_timeout_s: limit for a worker to import the tools (past it: ToolError); env:
        settings of the tools, in every worker's environment."""
        self._paths_json = json.dumps(paths)
        self._env = env
        self.max_workers = max_workers
        self.startup_timeout_s = startup_timeout_s
        self.workers = [self._start(read_schemas=True)]
        self._reports: list[dict] | None = None
        self._lock = threading.Lock()
        self._submitted: deque[tuple[ToolJob, Future]] = deque()
        """Calls not yet seen by the pool's thread (guarded by `_lock`)."""
        self._wake_up, self._waker = Pipe(duplex=False)
        """A byte on `_waker` wakes the thread from its wait on the workers (a submit, a close)."""
        self._thread: threading.Thread | None = None
        self._closing = False
        self._failure: Exception | None = None
        """Why the pool's thread stopped (a worker that cannot start): later calls fail with it."""

    def _start(self, read_schemas: bool = False) -> IsolatedProcess:
        return IsolatedProcess(
            "megarl.tools.worker", self._paths_json, "schemas" if read_schemas else "no-schemas", env=self._env
        )

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

    def submit(self, jobs: list[ToolJob]) -> list[Future]:
        """One future per job, in order, each set to its `ToolResult` when the call ends; returns at once."""
        futures = [Future() for _ in jobs]
        with self._lock:
            if self._failure is not None or self._closing:
                for future in futures:
                    future.set_exception(self._failure or RuntimeError("the tool pool is closed"))
                return futures
            self._submitted.extend(zip(jobs, futures))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="megarl-tool-pool", daemon=True)
                self._thread.start()
        self._waker.send_bytes(b"")
        return futures

    def _serve(self) -> None:
        """The pool's thread: dispatch queued calls to free workers, collect replies and deadlines."""
        queued: deque[tuple[ToolJob, Future]] = deque()
        busy: dict[int, tuple[ToolJob, Future, float, float]] = {}  # worker index -> (job, future, start, deadline)
        try:
            while True:
                with self._lock:
                    queued.extend(self._submitted)
                    self._submitted.clear()
                    if self._closing:
                        break
                while len(self.workers) < min(len(queued) + len(busy), self.max_workers):
                    self.workers.append(self._start())  # they import side by side; awaited when first used
                for index in range(len(self.workers)):
                    if queued and index not in busy:
                        busy[index] = self._dispatch(index, *queued.popleft())
                self._collect(busy)
        except Exception as error:  # a worker that cannot start: every call in flight, and later, fails
            with self._lock:
                self._failure = error
                queued.extend(self._submitted)
                self._submitted.clear()
        failure = self._failure or RuntimeError("the tool pool was closed before the call ended")
        for _, future, *_ in [*queued, *busy.values()]:
            future.set_exception(failure)

    def _dispatch(self, index: int, job: ToolJob, future: Future) -> tuple[ToolJob, Future, float, float]:
        if self.workers[index].exited():  # died while idle (e.g. the OOM killer)
            self._replace(index)
        worker = self.workers[index]
        self._wait_ready(worker)
        tool, arguments, timeout_s = job
        worker.connection.send((tool, arguments))
        start = time.monotonic()
        return job, future, start, start + timeout_s

    def _collect(self, busy: dict[int, tuple[ToolJob, Future, float, float]]) -> None:
        """Wait for a reply, a deadline or a wake-up; set the ended calls' futures, replace failed workers."""
        earliest = min((deadline for *_, deadline in busy.values()), default=None)
        timeout = None if earliest is None else max(0.0, earliest - time.monotonic())
        ready = wait([self._wake_up] + [self.workers[index].connection for index in busy], timeout=timeout)
        while self._wake_up.poll():
            self._wake_up.recv_bytes()
        now = time.monotonic()
        for index, (job, future, start, deadline) in list(busy.items()):
            worker = self.workers[index]
            if worker.connection in ready:
                del busy[index]
                try:
                    status, text = worker.connection.recv()
                except EOFError:  # the tool killed its worker (os._exit, a crash in C code)
                    status, text = "raised", f"the tool's process exited with code {worker.kill()}"
                    self._replace(index)
                future.set_result(
                    ToolResult(text, None, now - start)
                    if status == "ok"
                    else ToolResult.failed(status, f"Error: {text}", now - start)
                )
            elif now >= deadline:
                del busy[index]
                self._replace(index)
                future.set_result(
                    ToolResult.failed(
                        "timeout", f"Error: the tool ran longer than {job[2]:g} s and was stopped", now - start
                    )
                )

    def _replace(self, index: int) -> None:
        self.workers[index].kill()
        self.workers[index] = self._start()

    def close(self) -> None:
        """Stop the pool's thread (calls still in flight fail) and all workers (politely, then by SIGKILL)."""
        with self._lock:
            self._closing = True
            thread = self._thread
        if thread is not None:
            self._waker.send_bytes(b"")
            thread.join()
        for worker in self.workers:
            worker.stop(timeout_s=5.0)
        self.workers = []
