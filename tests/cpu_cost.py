"""The CPU-seconds each test costs, every process it starts included (its jobs, their Ray, vLLM and Megatron
processes), for the suite's closing table (`tests/conftest.py`).

On two cores the suite is CPU-bound (both busy ~98 % of a run), so its wall time is its CPU-seconds ÷ 2, and
a test's wall duration says little of its cost: a test that waits out a hang timeout lasts long and costs
nothing (the other process takes both cores), a whole job with a TP-2 engine costs twice its wall time.

Each pytest process moves itself into a cgroup of its own under the cgroup-v1 `cpuacct` hierarchy
(`/sys/fs/cgroup/cpuacct`; every process it starts inherits it) and reads the group's `cpuacct.usage`
(nanoseconds) around each test. Where that hierarchy is not mounted or not writable (not root, cgroup v2
only) the costs are not measured and the table says why.

    meter = CpuMeter.start()        # raises CpuMeterUnavailable (saying why) where it cannot measure
    before = meter.used_s()
    ...                             # the test, and whatever it starts
    cost = meter.used_s() - before
    meter.stop()                    # this process back in its cgroup; the group removed

This module is a pytest plugin (`-p tests.cpu_cost --cpu-report N`, as scripts/test.sh runs the suite):
`CpuReport` measures each test in the process that runs it, the costs travel to xdist's controller with the
reports, and the run ends with the table (`cost_table`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
"""The cgroup-v1 CPU accounting hierarchy."""


class CpuMeterUnavailable(RuntimeError):
    """This machine gives a process no CPU accounting of its own (the message says why)."""


@dataclass
class CpuMeter:
    group: Path
    """This process's own cgroup: megarl-tests-<pid> inside the one it started in (its parent)."""

    @classmethod
    def start(cls) -> CpuMeter:
        try:
            group = CPUACCT / _own_group() / f"megarl-tests-{os.getpid()}"
            group.mkdir(exist_ok=True)
            try:
                (group / "cgroup.procs").write_text(str(os.getpid()))
            except OSError:
                group.rmdir()
                raise
        except OSError as error:
            raise CpuMeterUnavailable(
                f"no writable cgroup-v1 cpuacct hierarchy at {CPUACCT} ({error.strerror or error})"
            ) from None
        return cls(group)

    def used_s(self) -> float:
        """CPU-seconds used so far by this process and every process it started."""
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def stop(self) -> None:
        """This process, and what it started that still runs (multiprocessing's fork server and resource
        tracker end after it), back in the cgroup it started in; the group removed."""
        for pid in (self.group / "cgroup.procs").read_text().split():
            try:
                (self.group.parent / "cgroup.procs").write_text(pid)
            except ProcessLookupError:  # ended meanwhile
                pass
        self.group.rmdir()


def _own_group() -> str:
    """This process's cgroup in the cpuacct hierarchy, relative to its root (/proc/self/cgroup's line
    `N:cpuacct:/path`, or `N:cpu,cpuacct:/path` where the two controllers share a hierarchy)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            return path.lstrip("/")
    raise FileNotFoundError("/proc/self/cgroup names no cpuacct hierarchy")


def cost_table(costs: dict[str, float], shown: int) -> list[str]:
    """The `shown` costliest tests and the sums by area (tests/e2e, tests/unit, ...), as report lines."""
    total = sum(costs.values())
    areas: dict[str, float] = {}
    for test, cost in costs.items():
        area = "/".join(test.split("::")[0].split("/")[:2])
        areas[area] = areas.get(area, 0.0) + cost
    lines = [f"{total:.0f} CPU-s in all: " + ", ".join(f"{a} {c:.0f}" for a, c in sorted(areas.items()))]
    for test, cost in sorted(costs.items(), key=lambda item: -item[1])[:shown]:
        lines.append(f"{cost:8.2f} CPU-s  {test}")
    return lines


class CpuReport:
    """The pytest plugin: a meter in each process that runs tests, the table in the one that reports."""

    def __init__(self, config: pytest.Config) -> None:
        self.shown: int = config.getoption("cpu_report")
        self.costs: dict[str, float] = {}
        self.unavailable = ""
        self.meter: CpuMeter | None = None
        # xdist's controller (-n 2) runs no test: its workers measure and send the costs with their reports.
        if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
            try:
                self.meter = CpuMeter.start()
            except CpuMeterUnavailable as error:
                self.unavailable = str(error)
        self.started = 0.0

    def pytest_unconfigure(self) -> None:
        if self.meter is not None:
            self.meter.stop()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self):
        # Around the whole protocol, not in a setup hook: a skip mark ends the setup before other plugins' hooks.
        if self.meter is not None:
            self.started = self.meter.used_s()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        if call.when == "teardown":
            report.user_properties.append(
                ("cpu_s", self.meter.used_s() - self.started) if self.meter else ("cpu_off", self.unavailable)
            )

    def pytest_runtest_logreport(self, report) -> None:
        for name, value in report.user_properties:
            if name == "cpu_s":
                self.costs[report.nodeid] = value
            elif name == "cpu_off":
                self.unavailable = value

    @pytest.hookimpl(trylast=True)  # after the durations
    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_sep("=", f"the {self.shown} costliest tests in CPU-seconds")
        if self.unavailable:
            terminalreporter.write_line(f"not measured: {self.unavailable}")
        for line in cost_table(self.costs, self.shown):
            terminalreporter.write_line(line)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-report",
        type=int,
        default=0,
        metavar="N",
        help="end with the N tests that cost the most CPU-seconds, every process they start included "
        "(tests/cpu_cost.py; on two busy cores a run's wall time is its CPU-seconds / 2)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("cpu_report"):
        config.pluginmanager.register(CpuReport(config), "cpu_report")
