"""`start_ray_early` on a real local Ray: the next `init_ray` joins the start it began (its resources and
worker environment, not the caller's) and leaves SIGTERM to the driver's handler, and a `shutdown_ray`
right after it leaves no Ray process behind
(the failure path of `megarl train` when the data or the tokenizer fails after the start began); a Ray the
caller initialized itself is joined and left running."""

import os
import signal

import psutil
import ray

from megarl.orchestration import cluster
from megarl.orchestration.cluster import init_ray, shutdown_ray, start_ray_early

RAY_PROCESSES = ("raylet", "gcs_server")


def _ray_children() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if any(name in " ".join(p.cmdline()) for name in RAY_PROCESSES)
    ]


@ray.remote
def _probe() -> str | None:
    return os.environ.get("MEGARL_EARLY_PROBE")


def test_init_ray_joins_the_early_start_and_sigterm_reaches_only_the_drivers_handler(capfd):
    """The core worker the early start brings up installs absl's failure-signal handler for SIGTERM at the
    C level (ray's src/ray/util/logging.cc, `InstallFailureSignalHandler`: it prints "*** SIGTERM received"
    and passes the signal on); the driver's own handler (`megarl.cli.stop_signals`) must get the signal alone."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    start_ray_early(num_cpus=1, env_vars={"MEGARL_EARLY_PROBE": "set by the early start"})
    try:
        init_ray(num_cpus=3, env_vars={})  # joins: the arguments of the start already begun hold
        assert ray.is_initialized()
        assert ray.cluster_resources()["CPU"] == 1
        assert ray.get(_probe.remote()) == "set by the early start"
        os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next statement
        assert received == [signal.SIGTERM]
        assert "SIGTERM received" not in capfd.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutdown_ray()
    assert not ray.is_initialized()


def test_shutdown_right_after_an_early_start_leaves_no_ray_process():
    start_ray_early(num_cpus=1)
    shutdown_ray()  # waits for the start, then stops the node it started
    assert not ray.is_initialized()
    _gone, alive = psutil.wait_procs(_ray_children(), timeout=30)
    assert alive == []


def test_a_ray_the_caller_initialized_is_joined_and_left_running():
    """A notebook's `ray.init()` before the trainer (here the same local start megarl makes, without `init_ray`):
    `init_ray` joins that instance and `shutdown_ray` at the end of the run leaves it to its owner."""
    cluster._start_local(1, None, {"env_vars": {"MEGARL_EARLY_PROBE": "the caller's"}})
    try:
        address = ray.get_runtime_context().gcs_address
        init_ray(num_cpus=3, env_vars={})
        assert ray.get_runtime_context().gcs_address == address and ray.cluster_resources()["CPU"] == 1
        shutdown_ray()
        assert ray.is_initialized() and ray.get(_probe.remote()) == "the caller's"
    finally:
        ray.shutdown()
    assert _ray_children() == [] or psutil.wait_procs(_ray_children(), timeout=30)[1] == []
