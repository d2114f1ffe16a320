"""Connect to Ray: join the cluster named by RAY_ADDRESS, else start a machine-local one.

A local instance is reachable from this machine only: its node address is 127.0.0.1, so Ray's
servers (GCS, raylet, core workers, agents) listen on loopback, no dashboard web server starts,
and the worker groups' rendezvous (hence gloo and megarl's stores) follow the node address. To
span machines, start a Ray cluster (`ray start`, scripts/ray_head.sh, KubeRay) and point
RAY_ADDRESS at it: its nodes' addresses are then the cluster's own.
"""

import os
import signal
import threading

import ray
from ray._private import ray_constants

LOCAL_HOST = "127.0.0.1"


def init_ray(num_cpus: int | None = None, num_gpus: int | None = None, env_vars: dict[str, str] | None = None) -> None:
    """Start or join Ray once per driver.

    `env_vars` reach every worker process (runtime env), e.g. the vLLM settings that must be set
    before vLLM is imported.
    """
    if ray.is_initialized():
        return
    # ray.init replaces the driver's SIGTERM handler by `sys.exit(15)` (ray/_private/worker.py, `init`), and
    # a driver stopped that way aborts (SIGABRT) while unwinding: the driver keeps the handler it had
    # (`megarl.cli.stop_signals`: one line, exit 143, every worker cleaned up).
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
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
    """Disconnect (and stop a local instance this driver started)."""
    if ray.is_initialized():
        ray.shutdown()
