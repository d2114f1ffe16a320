"""Connect to Ray: join the cluster named by RAY_ADDRESS, else start a local one without the dashboard."""

import os

import ray


def init_ray(num_cpus: int | None = None, num_gpus: int | None = None, env_vars: dict[str, str] | None = None) -> None:
    """Start or join Ray once per driver.

    `env_vars` reach every worker process (runtime env), e.g. the vLLM settings that must be set
    before vLLM is imported. A local instance starts no dashboard web server. It still listens beyond
    loopback: Ray 2.60 replaces a loopback node address by the machine's routable IP and its gRPC
    servers (GCS, raylet, workers, agents) listen on the node IP or all interfaces, so a job on a
    shared network needs a host firewall (tests/e2e/reliability/test_security.py lists the sockets).
    """
    if ray.is_initialized():
        return
    runtime_env = {"env_vars": dict(env_vars or {})}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
        return
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        runtime_env=runtime_env,
        log_to_driver=True,
    )


def shutdown_ray() -> None:
    """Disconnect (and stop a local instance this driver started)."""
    if ray.is_initialized():
        ray.shutdown()
