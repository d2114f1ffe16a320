"""Worker groups placed the way `cluster/roles.py` places them, on a Ray cluster with fake GPU counts
(Ray's GPU resources are logical: nothing here touches CUDA; the ranks form gloo worlds)."""

import contextlib

import pytest
import ray
from ray._private.node import Node
from ray._private.parameter import RayParams
from ray.util.placement_group import remove_placement_group

from megarl.cluster.roles import process_share
from megarl.orchestration.cluster import LOCAL_HOST, init_ray, shutdown_ray
from megarl.orchestration.placement import BundleSpec, create_placement_group
from megarl.orchestration.worker_group import WorkerGroup

GPUS_PER_NODE = 4
CPUS_PER_NODE = 2 * GPUS_PER_NODE
"""Logical CPUs: room for a colocated bundle (2 CPUs) per GPU."""
PROBE = "tests.e2e.orchestration.targets:DeviceProbe"
ENV = {"MEGARL_DEVICE": "cpu"}
"""The ranks compute on the CPU (gloo): only the GPU assignment is under test."""


@contextlib.contextmanager
def two_node_cluster():
    """A local Ray head (`init_ray`) with GPUS_PER_NODE fake GPUs, plus a second node joined to it with as
    many (a raylet of its own, as `ray start --address` would add; ray/cluster_utils.py: Cluster.add_node).
    The raylets start no idle workers ahead of need (one per logical CPU by default): every process here is
    a rank, and each idle one would cost a Python start on this small machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_prestart_worker_first_driver", "0")  # read by each raylet at its start
        init_ray(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE)
        second = None
        try:
            second = Node(
                RayParams(
                    num_cpus=CPUS_PER_NODE,
                    num_gpus=GPUS_PER_NODE,
                    node_ip_address=LOCAL_HOST,
                    gcs_address=ray.get_runtime_context().gcs_address,
                    include_log_monitor=False,
                    object_store_memory=150 * 1024**2,
                ),
                head=False,
                shutdown_at_exit=True,
                spawn_reaper=False,
            )
            assert ray.cluster_resources()["GPU"] == 2 * GPUS_PER_NODE
            yield
        finally:
            if second is not None:
                second.kill_all_processes(check_alive=False, allow_graceful=True)
            shutdown_ray()


def place(name: str, policy_ranks: int, rollout_ranks: int, colocated: bool) -> tuple[list[dict], list[dict]]:
    """Start a policy and a rollout group of `DeviceProbe`s on one-GPU bundles (colocated: rollout rank r
    shares policy rank r's bundle, each taking half its GPU; split: the rollout's bundles follow the
    policy's) and return each rank's report, policy then rollout."""
    bundles = policy_ranks if colocated else policy_ranks + rollout_ranks
    bundle = BundleSpec(cpus=2.0 if colocated else 1.0, gpus=1.0)  # as roles.device_bundles on CUDA
    pg = create_placement_group(name, bundles, bundle, timeout_s=30)
    role = process_share(bundle, 2 if colocated else 1)
    groups = []
    try:
        groups.append(WorkerGroup(f"{name}-policy", PROBE, policy_ranks, pg, role, env=ENV))
        groups.append(
            WorkerGroup(
                f"{name}-rollout",
                PROBE,
                rollout_ranks,
                pg,
                role,
                env=ENV,
                bundles=range(0 if colocated else policy_ranks, bundles),
            )
        )
        return tuple(group.call_all("report") for group in groups)
    finally:
        for group in groups:
            group.kill()
        remove_placement_group(pg)


def check_device_indices(reports: list[dict]) -> None:
    """Each rank's device index is valid for its visible GPUs and names the GPU Ray assigned it."""
    for report in reports:
        [gpu] = report["gpu_ids"]
        visible = report["visible"].split(",")
        assert 0 <= report["device_index"] < len(visible), report
        assert visible[report["device_index"]] == gpu, report
        assert report["backend"] == "gloo"
