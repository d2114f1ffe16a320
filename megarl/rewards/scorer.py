"""Scoring responses with a reward function that runs isolated: own processes, time limit, no secrets.

    with RewardScorer("megarl.rewards.tasks:repeat_first_char", timeout_s=10) as scorer:
        result = scorer(prompts, responses, **reward_columns(batch))   # RewardResult
        result.scores                     # [N] floats, 0.0 where the function failed
        result.metrics                    # {"reward/errors": ..., "reward/timeouts": ..., ...}

- **Processes.** `num_workers` long-lived worker processes (`megarl.rewards.worker`), started once
  and reused, so a call costs a pipe round trip, not an interpreter start. The responses are cut
  into chunks of `chunk_size`; each chunk is one call of the function in one worker, chunks run in
  parallel across workers.
- **Time limit.** A call may take `timeout_s` per response of its chunk (`reward.timeout_s` is "per
  response"). Past it the worker's whole process group is killed (SIGKILL: a hung function, and any
  process it started, is gone) and a fresh worker replaces it.
- **Failures.** A function that raises (or kills its worker) or times out scores 0 for that call's
  samples and is counted; the run goes on. A function that does not resolve or returns a bad result
  (wrong length, non-numbers, NaN, inf, beyond float32's range) raises `RewardFunctionError`: that
  is a bug and stops the run.
- **Secrets.** Workers start from the driver's environment minus every variable whose name looks
  like a credential (`megarl.isolation.SECRET_NAME`: HF_TOKEN, WANDB_API_KEY, ...), so reward code
  cannot read them. They see the driver's `sys.path` (as PYTHONPATH) and working directory.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from multiprocessing.connection import wait

from megarl.config.sections import RewardConfig
from megarl.isolation import IsolatedProcess, WorkerStartError
from megarl.rewards import code_tests
from megarl.rewards.functions import BUILTIN_REWARDS, RewardFunctionError, function_path

logger = logging.getLogger(__name__)

METRICS = ("reward/errors", "reward/timeouts", "reward/failed_samples")
"""Per call of the scorer: calls that raised or crashed, calls killed at the time limit, samples scored 0 by either."""


@dataclass(frozen=True)
class RewardResult:
    """Scores of one batch of responses and what went wrong producing them."""

    scores: list[float]
    """`[N]` one score per response, in order; 0.0 for samples whose call failed."""
    metrics: dict[str, float]
    """The `METRICS` counts of this batch."""
    first_error: str | None = None
    """The first failure of the batch in full (a traceback, or the time limit), None when none failed."""


def _summary(report: str) -> str:
    """One line for a failure report: a traceback's last line (`ValueError: bad input`)."""
    lines = [line for line in report.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def _report(reports: dict[str, tuple[int, str]], line: str, responses: int, report: str) -> None:
    """Count `responses` failed samples under `line`, keeping the first full `report` of each line."""
    counted, first = reports.get(line, (0, report))
    reports[line] = (counted + responses, first)


def _start_worker(spec: str, env: dict[str, str] | None) -> IsolatedProcess:
    return IsolatedProcess("megarl.rewards.worker", spec, env=env)


class RewardScorer:
    """Runs reward function `spec` (built-in name or `pkg.module:function`) in isolated worker processes."""

    def __init__(
        self,
        spec: str,
        *,
        timeout_s: float,
        num_workers: int = 2,
        chunk_size: int = 16,
        startup_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
    ):
        """timeout_s: time limit per response (a call gets timeout_s × its chunk's length); num_workers:
        worker processes; chunk_size: responses per call; startup_timeout_s: limit for a worker to
        import the function (past it: RewardFunctionError); env: settings the workers get in their
        environment (`reward.sandbox`: `megarl.rewards.code_tests.worker_settings`)."""
        if timeout_s <= 0 or num_workers < 1 or chunk_size < 1:
            raise ValueError(
                f"RewardScorer: need timeout_s > 0, num_workers >= 1, chunk_size >= 1; got "
                f"{timeout_s}, {num_workers}, {chunk_size}"
            )
        self.spec = spec
        self.timeout_s = timeout_s
        self.chunk_size = chunk_size
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        # Fail fast on a malformed spec; the import itself happens only in the workers.
        if ":" not in function_path(spec):
            raise RewardFunctionError(f"reward.function {spec!r}: neither a built-in nor `pkg.module:function`")
        self.workers = [_start_worker(spec, env) for _ in range(num_workers)]

    @classmethod
    def from_config(cls, reward: RewardConfig) -> RewardScorer:
        """The run's scorer. The `code` reward's programs must be able to run: where they cannot
        (`code_tests.check_sandbox`), RewardFunctionError naming the key, before any worker starts."""
        if function_path(reward.function) == BUILTIN_REWARDS["code"]:
            code_tests.check_sandbox(reward.sandbox)
        return cls(reward.function, timeout_s=reward.timeout_s, env=code_tests.worker_settings(reward.sandbox))

    def wait_ready(self) -> None:
        """Block until every worker imported the function: a function that does not resolve (its module
        fails to import, the name is missing) raises RewardFunctionError here, before any scoring."""
        for worker in self.workers:
            self._wait_ready(worker)

    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self.workers]

    def _wait_ready(self, worker: IsolatedProcess) -> None:
        if worker.ready:
            return
        try:
            failure = worker.receive_ready(self.startup_timeout_s)
        except WorkerStartError as error:
            raise RewardFunctionError(f"reward.function {self.spec!r}: the reward worker {error}") from None
        if failure is not None:
            raise RewardFunctionError(failure)

    def __call__(self, prompts: list[str], responses: list[str], **columns: list) -> RewardResult:
        """Score `responses` (`[N]`, with their `prompts` `[N]` and reward `columns`, each `[N]`)."""
        if not self.workers:
            raise RuntimeError(f"RewardScorer for {self.spec!r} is closed")
        count = len(responses)
        lengths = {"prompts": len(prompts), **{name: len(values) for name, values in columns.items()}}
        if any(length != count for length in lengths.values()):
            raise ValueError(f"RewardScorer: {count} responses but lengths {lengths}; pass one entry per response")
        chunks = deque(range(0, count, self.chunk_size))
        scores = [0.0] * count
        failures: Counter = Counter()
        reports: dict[str, tuple[int, str]] = {}  # one line per distinct failure -> (responses, first full report)
        busy: dict[int, tuple[int, int, float]] = {}  # worker index -> (start, stop, deadline)
        try:
            while chunks or busy:
                for index in range(len(self.workers)):
                    if chunks and index not in busy:
                        busy[index] = self._dispatch(index, chunks.popleft(), prompts, responses, columns)
                self._collect(busy, scores, failures, reports)
        finally:
            for index in busy:  # left mid-call by an error: their replies must not reach the next call
                self._replace(index)
        for line, (responses, _) in reports.items():  # one line per distinct failure, not a traceback per call
            logger.warning("reward.function %r: %d of %d responses scored 0: %s", self.spec, responses, count, line)
        return RewardResult(
            scores,
            {
                "reward/errors": float(failures["errors"]),
                "reward/timeouts": float(failures["timeouts"]),
                "reward/failed_samples": float(failures["failed_samples"]),
            },
            next((report for _, report in reports.values()), None),
        )

    def _dispatch(self, index: int, start: int, prompts, responses, columns) -> tuple[int, int, float]:
        """Send the chunk starting at `start` to worker `index`; returns (start, stop, deadline)."""
        if self.workers[index].exited():  # died while idle (e.g. the OOM killer)
            self._replace(index)
        worker = self.workers[index]
        stop = min(start + self.chunk_size, len(responses))
        self._wait_ready(worker)
        worker.connection.send(
            (
                start,
                prompts[start:stop],
                responses[start:stop],
                {name: values[start:stop] for name, values in columns.items()},
            )
        )
        return start, stop, time.monotonic() + self.timeout_s * (stop - start)

    def _collect(
        self,
        busy: dict[int, tuple[int, int, float]],
        scores: list[float],
        failures: Counter,
        reports: dict[str, tuple[int, str]],
    ) -> None:
        """Wait for the first reply or deadline among busy workers; record results, replace failed workers."""
        now = time.monotonic()
        earliest = min(deadline for _, _, deadline in busy.values())
        ready = wait([self.workers[index].connection for index in busy], timeout=max(0.0, earliest - now))
        now = time.monotonic()
        for index, (start, stop, deadline) in list(busy.items()):
            worker = self.workers[index]
            if worker.connection in ready:
                del busy[index]
                try:
                    status, payload = worker.connection.recv()
                except EOFError:  # the function killed its worker (os._exit, a crash in C code)
                    status, payload = "error", f"the worker exited with code {worker.kill()}"
                    self._replace(index)
                if status == "invalid":
                    raise RewardFunctionError(payload)
                if status == "ok":
                    scores[start:stop] = payload
                    continue
                failures["errors"] += 1
                failures["failed_samples"] += stop - start
                _report(reports, _summary(payload), stop - start, f"on responses {start}..{stop - 1}:\n{payload}")
            elif now >= deadline:
                del busy[index]
                self._replace(index)
                failures["timeouts"] += 1
                failures["failed_samples"] += stop - start
                limit = f"ran past reward.timeout_s = {self.timeout_s} s per response (worker killed)"
                _report(reports, limit, stop - start, f"on responses {start}..{stop - 1}: {limit}")

    def _replace(self, index: int) -> None:
        self.workers[index].kill()
        self.workers[index] = _start_worker(self.spec, self.env)

    def close(self) -> None:
        """Stop all workers (politely, then by SIGKILL); the scorer cannot be used afterwards."""
        for worker in self.workers:
            worker.stop(timeout_s=5.0)
        self.workers = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
