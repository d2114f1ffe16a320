"""Device assignment on a Ray cluster of two nodes with 4 fake GPUs each (Ray's GPU resources are
logical: nothing touches CUDA, the ranks form gloo worlds). Every rank gets its own GPU (colocated: shared
with its engine), and the device index the worker group computes (LOCAL_RANK, then
`torch.cuda.set_device`) is that GPU's position in the CUDA_VISIBLE_DEVICES Ray gave the process
(ray/_private/utils.py: set_visible_accelerator_ids -> ray/_private/accelerators/nvidia_gpu.py:
NvidiaGPUAcceleratorManager.set_current_process_visible_accelerator_ids), for colocated and split
placements, on one node and across two.

Both nodes listen on 127.0.0.1: Ray binds a node's servers to loopback only when its address is
127.0.0.1 itself (ray/dashboard/agent.py: `is_localhost(self.ip)`; a node on 127.0.0.2 opens raylet and
agent ports on every interface), and Ray tells nodes apart by id, not address.
"""

import pytest

from tests.e2e.orchestration.fake_gpus import GPUS_PER_NODE, check_device_indices, place, two_node_cluster


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster():
        yield


def placed_gpus(reports: list[dict]) -> set[tuple[str, str]]:
    """The (node, GPU id) pairs of the ranks (GPU ids repeat across nodes)."""
    return {(report["node"], gpu) for report in reports for gpu in report["gpu_ids"]}


def test_eight_colocated_ranks_across_two_nodes(cluster):
    policy, rollout = place("colocated-8", policy_ranks=8, rollout_ranks=8, colocated=True)
    assert len(placed_gpus(policy)) == 8 and len({r["node"] for r in policy}) == 2
    assert [(r["node"], r["gpu_ids"]) for r in rollout] == [(p["node"], p["gpu_ids"]) for p in policy]
    check_device_indices(policy + rollout)
    # Ray narrowed each process to its one GPU, so CUDA numbers it 0; the GPU id (up to 3) would be invalid.
    assert {r["device_index"] for r in policy + rollout} == {0}


def test_split_on_one_node(cluster):
    policy, rollout = place("split-1node", policy_ranks=1, rollout_ranks=1, colocated=False)
    assert len(placed_gpus(policy + rollout)) == 2 and len({r["node"] for r in policy + rollout}) == 1
    check_device_indices(policy + rollout)


def test_split_across_two_nodes(cluster):
    policy, rollout = place("split-2nodes", policy_ranks=3, rollout_ranks=2, colocated=False)
    assert len(placed_gpus(policy + rollout)) == 5 and len({r["node"] for r in policy + rollout}) == 2
    assert GPUS_PER_NODE == 4  # 5 one-GPU bundles cannot fit one node
    check_device_indices(policy + rollout)
