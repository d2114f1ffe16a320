"""scripts/test.sh, the README's test command (and CI's): it runs pytest on what it is given and ends
in two processes, and ends with the slowest tests and the costliest in CPU-seconds (tests/cpu_cost.py), so a
test that grows is seen in every run's output."""

import os
import re
import subprocess

import pytest
from deploy_support import REPO

from tests.cpu_cost import CpuMeter, CpuMeterUnavailable

SLOW_TEST = """
import time


def test_takes_over_a_second():
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:  # busy on purpose: the durations list shows tests over 1 s
        pass
"""

CPU_PROBE = """
import os
import subprocess
import sys

import pytest

BURN = (
    "import resource, time\\n"
    "end = time.process_time() + 0.5\\n"
    "while time.process_time() < end: pass\\n"
    "usage = resource.getrusage(resource.RUSAGE_SELF)\\n"
    "print(usage.ru_utime + usage.ru_stime)"
)


def test_starts_a_process_that_burns_cpu():
    used = subprocess.run([sys.executable, "-c", BURN], capture_output=True, text=True, check=True).stdout
    with open(os.environ["CPU_PROBE_OUT"], "w") as f:
        f.write(used)


@pytest.mark.skip(reason="a skip mark ends the setup before the CPU meter's own hooks")
def test_skipped_after_it():
    pass
"""


def test_test_script_lists_the_slowest_tests_and_the_costliest(tmp_path):
    """The CPU cost of a test counts the processes it starts: the probe's child burns 0.5 CPU-seconds and
    reports its own total, which the table's figure for the test must cover; the skipped test after it costs
    its own time, not the one before it."""
    (tmp_path / "test_slow_probe.py").write_text(SLOW_TEST)
    (tmp_path / "test_cpu_probe.py").write_text(CPU_PROBE)
    probe_out = tmp_path / "child_cpu_s"
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "test.sh"), str(tmp_path), "--rootdir", str(tmp_path), "-c", "/dev/null"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CPU_PROBE_OUT": str(probe_out)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 workers" in result.stdout  # pytest-xdist's "created: 2/2 workers": the suite runs in two processes
    durations, costs = result.stdout.split("slowest 25 durations")[1].split("25 costliest tests in CPU-seconds")
    assert "test_slow_probe.py::test_takes_over_a_second" in durations
    try:
        CpuMeter.start().stop()
    except CpuMeterUnavailable as error:
        assert f"not measured: {error}" in costs
        pytest.skip(f"no CPU accounting here: {error}")
    cost = re.search(r"([\d.]+) CPU-s  test_cpu_probe.py::test_starts_a_process_that_burns_cpu", costs)
    assert cost and float(cost.group(1)) >= float(probe_out.read_text()) - 0.005, costs  # the table's 2 decimals
    skipped = re.search(r"([\d.]+) CPU-s  test_cpu_probe.py::test_skipped_after_it", costs)
    assert skipped and float(skipped.group(1)) < float(probe_out.read_text()), costs  # not the test before it
