"""`start_ray_early` on a real local Ray: the next `init_ray` joins the start it began (its resources and
worker environment, not the caller's), and a `shutdown_ray` right after it leaves no Ray process behind
(the failure path of `megarl train` when the data or the tokenizer fails after the start began)."""

import os

import psutil
import ray

from megarl.orchestration.cluster import init_ray, shutdown_ray, start_ray_early

RAY_PROCESSES = ("raylet", "gcs_server")


def _ray_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if any(name in " ".join(p.cmdline()) for name in RAY_PROCESSES)]


@ray.remote
def _probe() -> str | None:
    return os.environ.get("MEGARL_EARLY_PROBE")


def test_init_ray_joins_the_early_start():
    start_ray_early(num_cpus=1, env_vars={"MEGARL_EARLY_PROBE": "set by the early start"})
    try:
        init_ray(num_cpus=3, env_vars={})  # joins: the arguments of the start already begun hold
        assert ray.is_initialized()
        assert ray.cluster_resources()["CPU"] == 1
        assert ray.get(_probe.remote()) == "set by the early start"
    finally:
        shutdown_ray()
    assert not ray.is_initialized()


def test_shutdown_right_after_an_early_start_leaves_no_ray_process():
    start_ray_early(num_cpus=1)
    shutdown_ray()  # waits for the start, then stops the node it started
    assert not ray.is_initialized()
    gone, alive = psutil.wait_procs(_ray_children(), timeout=30)
    assert alive == []
