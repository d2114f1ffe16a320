"""A TP > 1 engine on GPUs runs vLLM's Ray executor, placed by `megarl.workers.rollout.executor` onto the
engine's bundles of the job's placement group. The Ray executor cannot start here (the CPU platform has
no Ray device: `vllm/platforms/interface.py: Platform.ray_device_key = ""`, and `initialize_ray_cluster`
refuses that), so these tests hold megarl's side against the installed vLLM's code (0.32):
  vllm/envs.py                              VLLM_RAY_BUNDLE_INDICES, VLLM_RAY_PER_WORKER_GPUS
  vllm/v1/executor/abstract.py              Executor.get_class: "ray" -> RayExecutorV2 / RayDistributedExecutor
  vllm/v1/executor/ray_executor_v2.py       RayExecutorV2._init_executor, _get_actor_resource_kwargs
  vllm/v1/executor/ray_executor.py          RayDistributedExecutor._init_workers_ray
  vllm/v1/executor/ray_utils.py             initialize_ray_cluster, get_bundles_for_indices
"""

import inspect
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import vllm
import vllm.envs
from vllm.config.parallel import DistributedExecutorBackend
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.executor import ray_executor_v2, ray_utils
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.ray_executor import RayDistributedExecutor
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

from megarl.workers.rollout.executor import engine_env, executor_backend

pytestmark = pytest.mark.unit

BUNDLES = [4, 5]
"""Engine 2 of the seeds' layout (6 GPUs, rollout TP 2): bundles 4 and 5."""
SHARE = 1 / 3
"""Its workers' GPU share when colocated with the actor and a reference group of its own."""


def test_the_backends_are_vllm_executor_backends():
    chosen = {executor_backend(tp, on_gpu) for tp in (1, 2, 4) for on_gpu in (False, True)}
    assert chosen == {"uni", "mp", "ray"}
    assert chosen <= set(typing.get_args(DistributedExecutorBackend))
    get_class = inspect.getsource(Executor.get_class)
    assert 'distributed_executor_backend == "ray"' in get_class
    assert "RayExecutorV2" in get_class and "RayDistributedExecutor" in get_class


def test_ray_is_for_gpus_only():
    """The CPU platform has no Ray device key, which `initialize_ray_cluster` refuses ("does not support
    ray"): TP > 1 on CPU takes the mp executor. The CUDA platform's key is "GPU" (cuda.py; the module
    itself needs vLLM's CUDA extension to import, so its source is read)."""
    assert CpuPlatform.ray_device_key == ""
    assert "does not support ray" in inspect.getsource(ray_utils.initialize_ray_cluster)
    assert executor_backend(2, on_gpu=False) == "mp"
    cuda_source = (Path(vllm.__file__).parent / "platforms" / "cuda.py").read_text()
    assert 'ray_device_key: str = "GPU"' in cuda_source


def test_vllm_reads_our_environment_as_we_mean_it(monkeypatch):
    """vLLM parses VLLM_RAY_BUNDLE_INDICES as `list(map(int, value.split(",")))` (both executors) and
    VLLM_RAY_PER_WORKER_GPUS as a float."""
    for name, value in engine_env(BUNDLES, SHARE).items():
        monkeypatch.setenv(name, value)
    assert list(map(int, vllm.envs.VLLM_RAY_BUNDLE_INDICES.split(","))) == BUNDLES
    assert vllm.envs.VLLM_RAY_PER_WORKER_GPUS == SHARE
    for source in (
        inspect.getsource(RayExecutorV2._init_executor),
        inspect.getsource(RayDistributedExecutor._init_workers_ray),
    ):
        assert "envs.VLLM_RAY_BUNDLE_INDICES.split" in source


def test_each_worker_asks_its_share_of_a_gpu(monkeypatch):
    """RayExecutorV2 asks `num_gpus=VLLM_RAY_PER_WORKER_GPUS` for each worker actor on a "GPU" platform
    (the platform is a stand-in with the CUDA platform's key) and no CPU (`num_cpus=0`), so colocated
    workers fit beside the trainer's shares of the same bundle; the older executor asks the same."""
    monkeypatch.setenv("VLLM_RAY_PER_WORKER_GPUS", engine_env(BUNDLES, SHARE)["VLLM_RAY_PER_WORKER_GPUS"])
    monkeypatch.setattr(ray_executor_v2, "current_platform", SimpleNamespace(ray_device_key="GPU"))
    assert RayExecutorV2._get_actor_resource_kwargs() == {"num_gpus": SHARE}
    assert "num_cpus=0" in inspect.getsource(RayExecutorV2._init_executor)
    old = inspect.getsource(RayDistributedExecutor._init_workers_ray)
    assert "num_gpus = envs.VLLM_RAY_PER_WORKER_GPUS" in old and "num_cpus=0" in old


def test_tp_rank_r_goes_to_the_rth_bundle_of_the_current_placement_group():
    """`initialize_ray_cluster` takes the placement group of the calling actor (the engine's actor runs
    in the job's group), `get_bundles_for_indices` keeps the indices in order, and RayExecutorV2 gives
    rank r the r-th of them."""
    assert "ray.util.get_current_placement_group()" in inspect.getsource(ray_utils.initialize_ray_cluster)
    assert list(inspect.signature(ray_utils.get_bundles_for_indices).parameters) == [
        "placement_group",
        "bundle_indices",
        "world_size",
    ]
    assert "for bid in bundle_indices" in inspect.getsource(ray_utils.get_bundles_for_indices)
    init = inspect.getsource(RayExecutorV2._init_executor)
    assert "for rank, (bundle_id_idx, node_id, node_ip) in enumerate(bundle_to_node_id)" in init
    assert 'placement_group_bundle_index=bundle["bundle_id_idx"]' in init


def test_bundles_of_one_gpu_each():
    """vLLM refuses a placement group whose bundles hold more than one GPU; megarl's have one each
    (`roles.start_roles`: BundleSpec(gpus=1.0) on CUDA)."""
    assert "Placement group bundle cannot have more than 1" in inspect.getsource(ray_utils.initialize_ray_cluster)
    roles_source = (Path(__file__).resolve().parents[3] / "megarl" / "cluster" / "roles.py").read_text()
    assert 'gpus=1.0 if device == "cuda" else 0.0' in roles_source
