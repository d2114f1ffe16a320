"""scripts/test.sh, the README's test command (and CI's): it runs pytest on what it is given and ends
in two processes, and ends with the slowest tests, so a test that grows is seen in every run's output."""

import subprocess

from deploy_support import REPO

SLOW_TEST = """
import time


def test_takes_over_a_second():
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:  # busy on purpose: the durations list shows tests over 1 s
        pass
"""


def test_test_script_lists_the_slowest_tests(tmp_path):
    test_file = tmp_path / "test_slow_probe.py"
    test_file.write_text(SLOW_TEST)
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "test.sh"), str(test_file), "--rootdir", str(tmp_path), "-c", "/dev/null"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 workers" in result.stdout  # pytest-xdist's "created: 2/2 workers": the suite runs in two processes
    assert "slowest 25 durations" in result.stdout
    assert "test_slow_probe.py::test_takes_over_a_second" in result.stdout.split("slowest 25 durations")[1]
