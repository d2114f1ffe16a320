"""Connect to Ray: join the cluster named by RAY_ADDRESS, else start a local one bound to 127.0.0.1."""

import os

import ray


def init_ray(num_cpus: int | None = None, num_gpus: int | None = None, env_vars: dict[str, str] | None = None) -> None:
    """Start or join Ray once per driver.

    `env_vars` reach every worker process (runtime env), e.g. the vLLM settings that must be set
    before vLLM is imported. A local instance binds to 127.0.0.1 and starts no dashboard, so nothing
    listens beyond this machine unless a cluster was started that way on purpose.
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
        _node_ip_address="127.0.0.1",
        runtime_env=runtime_env,
        log_to_driver=True,
    )


def shutdown_ray() -> None:
    """Disconnect (and stop a local instance this driver started)."""
    if ray.is_initialized():
        ray.shutdown()
