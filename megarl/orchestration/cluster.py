"""Connect to Ray: join the cluster named by RAY_ADDRESS, else start a machine-local one.

A local instance is reachable from this machine only: its node address is 127.0.0.1, so Ray's
servers (GCS, raylet, core workers, agents) listen on loopback, no dashboard web server starts,
and the worker groups' rendezvous (hence gloo and megarl's stores) follow the node address. To
span machines, start a Ray cluster (`ray start`, scripts/ray_head.sh, KubeRay) and point
RAY_ADDRESS at it: its nodes' addresses are then the cluster's own.

A driver that is about to spend seconds importing and loading its data can begin the start first
(`start_ray_early`): the node's processes come up on the other cores meanwhile (`megarl train` saves
about 2 s of its launch so).
"""

import os
import signal
import threading
from concurrent.futures import Future

import ray
from ray._private import ray_constants

LOCAL_HOST = "127.0.0.1"

_early_start: Future | None = None
"""A start begun by `start_ray_early`: the next `init_ray` or `shutdown_ray` waits for it."""
_node_stopped: threading.Event | None = None
"""Set by `shutdown_ray`: the thread that started the node may end (`_start_and_stay`)."""


def start_ray_early(num_cpus: int | None = None, env_vars: dict[str, str] | None = None) -> None:
    """Begin `init_ray(num_cpus, env_vars=env_vars)` in a background thread and return at once. The
    next `init_ray` waits for it and raises what it raised; `shutdown_ray` waits for it, then stops Ray,
    so a driver that fails before using Ray leaves no node behind."""
    global _early_start, _node_stopped
    if _early_start is not None or ray.is_initialized():
        return
    _early_start, _node_stopped = Future(), threading.Event()
    threading.Thread(target=_start_and_stay, args=(_early_start, _node_stopped, num_cpus, env_vars),
                     name="megarl-ray-start", daemon=True).start()


def _start_and_stay(started: Future, node_stopped: threading.Event, num_cpus: int | None,
                    env_vars: dict[str, str] | None) -> None:
    """Start Ray, then wait until it is shut down: Ray spawns its node processes (GCS, raylet) with a
    parent-death signal (ray/_private/services.py, `set_kill_on_parent_death_linux`), and on Linux that
    signal fires when the spawning *thread* ends, so this thread must outlive the node."""
    # Off the main thread Ray leaves SIGTERM's handler alone, as `init_ray` wants (its warning that it did
    # is one of `megarl.quiet.LOGS`).
    try:
        _start_or_join(num_cpus, None, {"env_vars": dict(env_vars or {})})
    except BaseException as error:  # raised by the `init_ray` or `shutdown_ray` that joins this start
        started.set_exception(error)
        return
    started.set_result(None)
    node_stopped.wait()


def _join_early_start() -> bool:
    """Wait for a start `start_ray_early` began (raising its error); whether there was one."""
    global _early_start
    pending, _early_start = _early_start, None
    if pending is None:
        return False
    pending.result()
    return True


def init_ray(num_cpus: int | None = None, num_gpus: int | None = None, env_vars: dict[str, str] | None = None) -> None:
    """Start or join Ray once per driver.

    `env_vars` reach every worker process (runtime env), e.g. the vLLM settings that must be set
    before vLLM is imported.
    """
    # The driver keeps the SIGTERM handler it had (`megarl.cli.stop_signals`: one line, exit 143, every
    # worker cleaned up), which Ray takes twice: ray.init on the main thread replaces the Python handler
    # by `sys.exit(15)` (ray/_private/worker.py, `init`), and a driver stopped that way aborts (SIGABRT)
    # while unwinding; and the core worker, from whichever thread starts it (`start_ray_early`'s too),
    # installs absl's failure-signal handler for SIGTERM at the C level ("*** SIGTERM received ...",
    # then it passes the signal on), which setting the Python handler again replaces.
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if not (_join_early_start() or ray.is_initialized()):
            _start_or_join(num_cpus, num_gpus, {"env_vars": dict(env_vars or {})})
    finally:
        if sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)


def _start_or_join(num_cpus: int | None, num_gpus: int | None, runtime_env: dict) -> None:
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
        return
    # Ray 2.60 replaces a loopback node address by the machine's routable IP
    # (services.resolve_ip_for_localhost) unless its single-machine mode is on: the default on
    # macOS/Windows, switched by RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER, which Ray reads once at import.
    # Only while this driver starts its node: joining a cluster later must see the real addresses.
    cluster_mode, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=True,
            _node_ip_address=LOCAL_HOST,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode


def cluster_gpus() -> float:
    """The GPU resources of the whole Ray cluster (every node's, not this driver's machine's)."""
    return ray.cluster_resources().get("GPU", 0.0)


def shutdown_ray() -> None:
    """Disconnect (and stop a local instance this driver started, or is starting: `start_ray_early`)."""
    global _node_stopped
    try:
        _join_early_start()
    except Exception:  # a start that failed left nothing to stop
        pass
    if ray.is_initialized():
        ray.shutdown()
    if _node_stopped is not None:
        _node_stopped.set()
        _node_stopped = None
