"""A stop signal during a benchmark (issue 33, items 7 and 11): the peer's process, which `megarl bench`
runs beside it (`megarl.bench.common.run_stoppable`), ends with every process it started, and the timed
loop stops between two calls; `megarl bench` then prints one line and exits with the signal's code
(the whole command: tests/e2e/reliability/test_stop_signals_other_commands.py)."""

import signal
import sys
import threading

import pytest
from process_testing import wait_until_gone

from megarl import interrupt
from megarl.bench.common import run_stoppable, time_interleaved
from megarl.interrupt import Stopped


@pytest.fixture
def stop_requests(monkeypatch):
    monkeypatch.setattr(interrupt, "_requested", None)  # the process-wide request, this test's only


def test_a_stop_ends_the_peer_and_the_processes_it_started(tmp_path, stop_requests):
    started = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, pathlib; child = subprocess.Popen(['sleep', '3600']); "
        f"pathlib.Path({str(started)!r}).write_text(str(child.pid)); child.wait()"
    )
    seen = threading.Event()

    def stop_once_started():
        while not started.exists() or not started.read_text():
            seen.wait(0.05)
        interrupt.request(Stopped(signal.SIGTERM, None))

    stopper = threading.Thread(target=stop_once_started)
    stopper.start()
    with pytest.raises(Stopped):
        run_stoppable([sys.executable, "-c", script])
    stopper.join()
    # Killed: its pipes closed before the kernel made it a zombie, so its end is awaited, not looked at once.
    assert wait_until_gone(int(started.read_text()))


def test_a_peer_that_finishes_returns_its_output(stop_requests):
    done = run_stoppable([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_the_timed_loop_stops_between_two_calls(stop_requests):
    calls = []

    def contender():
        calls.append(1)
        if len(calls) == 2:
            interrupt.request(Stopped(signal.SIGINT, None))

    with pytest.raises(Stopped):
        time_interleaved({"a": contender}, repeats=10)
    assert len(calls) == 2
