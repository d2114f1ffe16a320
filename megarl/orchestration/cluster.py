"""Connect to Ray: join the cluster named by RAY_ADDRESS, else start a machine-local one.

A local instance is reachable from this machine only: its node address is 127.0.0.1, so Ray's
servers (GCS, raylet, core workers, agents) listen on loopback, no dashboard web server starts,
and the worker groups' rendezvous (hence gloo and megarl's stores) follow the node address. To
span machines, start a Ray cluster (`ray start`, scripts/ray_head.sh, KubeRay) and point
RAY_ADDRESS at it: its nodes' addresses are then the cluster's own.

A driver that is about to spend seconds importing and loading its data can begin the start first
(`start_ray_early`): the node's processes come up on the other cores meanwhile (`megarl train` saves
about 2 s of its launch so).

What Ray itself reports badly is a `RayStartError` of one line naming the cause and the fix
(`check_ray_can_start`, also called by the CLIs before they write anything): a RAY_ADDRESS where
nothing listens (Ray retries it for minutes), a temp directory too long for the node's Unix sockets
(a traceback from deep inside Ray), and a local start that timed out twice (under load Ray's start
sometimes times out; it is retried once).
"""

import os
import signal
import socket
import threading
from concurrent.futures import Future

import psutil
import ray
from ray._common.utils import get_default_ray_temp_dir
from ray._private import ray_constants

LOCAL_HOST = "127.0.0.1"
RAY_PACKAGE = os.path.dirname(ray.__file__)

SOCKET_PATH_MAX = 107
"""Bytes of a Unix socket path on Linux (`sun_path` is 108, with its NUL; ray/_private/utils.py,
`validate_socket_filepath`)."""
LONGEST_SOCKET_SUFFIX = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
"""What Ray appends to its temp dir for its longest socket (ray/_private/node.py: the session name, the
date to microseconds and a pid up to Linux's pid_max 4194304; `_prepare_socket_file`)."""
WORKER_PRIORITY = {ray_constants.RAY_WORKER_NICENESS: "0"}
"""Every worker process of the job (the ranks, the engines, what they start) runs at the priority of the
processes around it. Ray starts its workers at niceness 15 (its `worker_niceness`, read from this variable
by each worker, as Ray's own job manager sets it for its job supervisors), which lets any busy process on
the node starve them: under a neighbour's load a rank's heartbeat thread went unscheduled for the whole
hang timeout (15 s) and the driver reported a live rank as frozen."""
ADDRESS_PROBE_S = 5.0
"""How long a TCP connection to RAY_ADDRESS may take before it counts as pointing at nothing."""


class RayStartError(RuntimeError):
    """Ray cannot be started or joined here; the message names the cause and the fix."""


_early_start: Future | None = None
"""A start begun by `start_ray_early`: the next `init_ray` or `shutdown_ray` waits for it."""
_node_stopped: threading.Event | None = None
"""Set by `shutdown_ray`: the thread that started the node may end (`_start_and_stay`)."""
_ours = False
"""Ray was started or joined here by `init_ray` (or `start_ray_early`), not initialized by the caller before
(a notebook's `ray.init()`): `shutdown_ray` disconnects only from a Ray it brought up, as verl's and slime's
drivers leave a Ray they found running."""


def start_ray_early(num_cpus: int | None = None, env_vars: dict[str, str] | None = None) -> None:
    """Begin `init_ray(num_cpus, env_vars=env_vars)` in a background thread and return at once. The
    next `init_ray` waits for it and raises what it raised; `shutdown_ray` waits for it, then stops Ray,
    so a driver that fails before using Ray leaves no node behind."""
    global _early_start, _node_stopped, _ours
    if _early_start is not None or ray.is_initialized():
        return
    _early_start, _node_stopped, _ours = Future(), threading.Event(), True
    threading.Thread(
        target=_start_and_stay,
        args=(_early_start, _node_stopped, num_cpus, env_vars),
        name="megarl-ray-start",
        daemon=True,
    ).start()


def _start_and_stay(
    started: Future, node_stopped: threading.Event, num_cpus: int | None, env_vars: dict[str, str] | None
) -> None:
    """Start Ray, then wait until it is shut down: Ray spawns its node processes (GCS, raylet) with a
    parent-death signal (ray/_private/services.py, `set_kill_on_parent_death_linux`), and on Linux that
    signal fires when the spawning *thread* ends, so this thread must outlive the node."""
    # Off the main thread Ray leaves SIGTERM's handler alone, as `init_ray` wants (its warning that it did
    # is one of `megarl.quiet.LOGS`).
    try:
        _start_or_join(num_cpus, None, env_vars)
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
    """Start or join Ray once per driver; a Ray the caller initialized in this process is used as it is (and
    `shutdown_ray` leaves it running).

    `env_vars` reach every worker process (runtime env), e.g. the vLLM settings that must be set
    before vLLM is imported (the worker groups also set them in their ranks: `megarl.cluster.roles`).
    """
    global _ours
    # The driver keeps the SIGTERM handler it had (`megarl.cli.stop_signals`: one line, exit 143, every
    # worker cleaned up), which Ray takes twice: ray.init on the main thread replaces the Python handler
    # by `sys.exit(15)` (ray/_private/worker.py, `init`), and a driver stopped that way aborts (SIGABRT)
    # while unwinding; and the core worker, from whichever thread starts it (`start_ray_early`'s too),
    # installs absl's failure-signal handler for SIGTERM at the C level ("*** SIGTERM received ...",
    # then it passes the signal on), which setting the Python handler again replaces.
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if not (_join_early_start() or ray.is_initialized()):
            _ours = True  # before the start: one that fails half-way is still this driver's to stop
            _start_or_join(num_cpus, num_gpus, env_vars)
    finally:
        if sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)


def check_ray_can_start() -> None:
    """`RayStartError` if joining RAY_ADDRESS (set) or starting a local node (unset) cannot work: nothing
    answers at the address, or the temp directory leaves no room for the node's socket paths."""
    address = os.environ.get("RAY_ADDRESS")
    if address:
        _check_address(address)
        return
    temp_dir = get_default_ray_temp_dir()
    room = SOCKET_PATH_MAX - LONGEST_SOCKET_SUFFIX
    if len(temp_dir.encode()) > room:
        variable = "RAY_TMPDIR" if "RAY_TMPDIR" in os.environ else "TMPDIR"
        raise RayStartError(
            f"{variable}={os.environ.get(variable)!r} is too long for Ray: its node's Unix socket paths "
            f"({temp_dir}/session_.../sockets/plasma_store) would pass the {SOCKET_PATH_MAX}-byte limit; fix: set "
            f"RAY_TMPDIR to a directory of at most {room - len('/ray')} bytes, e.g. RAY_TMPDIR=/tmp"
        )


def _check_address(address: str) -> None:
    """Ray resolves `auto` and `local` itself; a host:port (or ray://host:port) must accept a connection."""
    if address in ("auto", "local"):
        return
    host, colon, port = address.split("://", 1)[-1].rpartition(":")
    if not colon or not port.isdigit():
        raise RayStartError(
            f"RAY_ADDRESS={address!r} is not an address of a Ray cluster; fix: set it to the head "
            "node's host:port (e.g. 10.0.0.1:6379), or unset it to run on a local Ray instance"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_PROBE_S).close()
    except OSError as error:
        raise RayStartError(
            f"RAY_ADDRESS={address!r}: no Ray cluster answers at {host}:{port} ({error.strerror or error}); fix: "
            f"start it (ray start --head --port={port}) or point RAY_ADDRESS at a running one, or unset RAY_ADDRESS "
            "to run on a local Ray instance"
        ) from None


def _start_or_join(num_cpus: int | None, num_gpus: int | None, env_vars: dict[str, str] | None) -> None:
    check_ray_can_start()
    runtime_env = {"env_vars": {**WORKER_PRIORITY, **(env_vars or {})}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
        return
    for attempt in (1, 2):
        before = _ray_processes()
        try:
            _start_local(num_cpus, num_gpus, runtime_env)
            return
        except Exception as error:
            if not _timed_out(error):
                raise
            # A start that timed out leaves what it started running (its GCS server: Ray records no node
            # that ray.shutdown would stop).
            _kill(_ray_processes() - before)
            if attempt == 2:
                raise RayStartError(
                    f"Ray's local node did not start in time, twice ({error}); the machine is likely overloaded; "
                    "fix: run again once it is less busy, or start a node yourself (ray start --head) and set "
                    "RAY_ADDRESS to it"
                ) from None


def _ray_processes() -> set[psutil.Process]:
    """This process's descendants that run Ray's programs (GCS server, raylet, its Python daemons)."""
    return {p for p in psutil.Process().children(recursive=True) if _runs_ray(p)}


def _runs_ray(process: psutil.Process) -> bool:
    try:
        return any(part.startswith(RAY_PACKAGE) for part in process.cmdline())
    except psutil.Error:
        return False


def _kill(processes: set[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(processes), timeout=30)


def _timed_out(error: Exception) -> bool:
    """Whether a start failed by one of Ray's start-up timeouts: a `TimeoutError`, the plain Exception
    "The current node timed out during startup" (ray/_private/node.py), or the node's first connection to its
    GCS server giving up ("Failed to connect to GCS", ray/_private/state.py `_connect_and_get_accessor`, as
    `Node.__init__` reads its own node's record: a GCS server slow to start on a loaded machine)."""
    message = str(error).lower()
    return isinstance(error, TimeoutError) or "timed out" in message or "failed to connect to gcs" in message


def _start_local(num_cpus: int | None, num_gpus: int | None, runtime_env: dict) -> None:
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


def driver_node_address() -> str:
    """This process's node address as Ray names the nodes (`WorkerGroup.nodes`)."""
    return ray.util.get_node_ip_address()


def shutdown_ray() -> None:
    """Disconnect (and stop a local instance this driver started, or is starting: `start_ray_early`); a Ray
    the caller initialized itself stays as it is."""
    global _node_stopped, _ours
    try:
        _join_early_start()
    except Exception:  # a start that failed left nothing to stop
        pass
    if ray.is_initialized() and _ours:
        ray.shutdown()
    _ours = False
    if _node_stopped is not None:
        _node_stopped.set()
        _node_stopped = None
