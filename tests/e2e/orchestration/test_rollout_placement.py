"""Rollout engines of TP 2 placed by `roles.start_rollout` on a Ray cluster with 6 fake GPUs (Ray's GPU
resources are logical: nothing touches CUDA), in the seeds' layout (colocated, rollout TP 2: 3 engines).
Each engine's actor runs on the first bundle of its pair and holds no GPU, joining the rollout group's
world with gloo though the run is a CUDA one; its TP workers, started as vLLM's Ray executor starts them
(`targets.EngineProbe`), take their bundle's GPU share, one GPU each; the shares left are the trainer's.
The bundles are addressed through the run's slots (`placement.gpu_slots`, probed on the fake GPUs)."""

import pytest
import ray

from megarl.cluster import ray_node, roles
from megarl.config.batch_plan import plan_batches
from megarl.config.loader import build_config
from megarl.orchestration import placement
from megarl.orchestration.cluster import init_ray, shutdown_ray
from megarl.orchestration.placement import BundleSpec, create_placement_group
from megarl.parallel.device import worker_env

SEEDS = {
    "data": {"train_batch_size": 12},
    "rollout": {"n": 8, "tensor_model_parallel_size": 2},
    "actor": {"ppo_mini_batch_size": 12, "micro_batch_size_per_gpu": 8},
    "placement": {"gpus_per_node": 6},
}


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_prestart_worker_first_driver", "0")  # no idle workers: every process is a probe
        init_ray(num_cpus=12, num_gpus=6)
        try:
            yield
        finally:
            shutdown_ray()


def test_the_seeds_engines_span_their_bundle_pairs(cluster, monkeypatch):
    problems = []
    config = build_config(SEEDS, problems)
    assert problems == []
    plan = plan_batches(config)
    bundles, cpus = ray_node.device_bundles(plan)
    bundle = BundleSpec(cpus=cpus, gpus=1.0)  # as roles.start_roles on CUDA
    pg = create_placement_group("rollout-tp2", bundles, bundle, timeout_s=30)
    share = roles.process_share(bundle, plan.processes_per_train_gpu)
    monkeypatch.setattr(roles, "ROLLOUT_TARGET", "tests.e2e.orchestration.targets:EngineProbe")
    slots = placement.gpu_slots(pg, bundles)
    assert sorted(slots) == list(range(bundles))
    group = roles.start_rollout(config, plan, pg, slots, share.gpus, worker_env("cuda"), eager=True)
    try:
        engines = group.call_all("report")
        assert [(engine["bundles"], engine["gpu_ids"], engine["backend"]) for engine in engines] == [
            ([slots[0]], [], "gloo"),
            ([slots[2]], [], "gloo"),
            ([slots[4]], [], "gloo"),
        ]
        workers = [worker for engine in engines for worker in engine["workers"]]
        assert [worker["bundles"] for worker in workers] == [[slot] for slot in slots]
        assert len({gpu for worker in workers for gpu in worker["gpu_ids"]}) == 6
        # vLLM gives TP rank r of an engine the r-th lowest GPU id of its workers (ray_executor.py:
        # _init_workers_ray): in slot order, that is the GPU Ray gave the rank's own bundle.
        for engine in engines:
            ids = [int(gpu) for worker in engine["workers"] for gpu in worker["gpu_ids"]]
            assert ids == sorted(ids), engine
        # Each GPU keeps the share of the trainer's process: 6 GPUs − 6 workers × 1/2.
        assert ray.available_resources()[f"GPU_group_{pg.id.hex()}"] == pytest.approx(3.0)
    finally:
        group.kill()
        ray.util.remove_placement_group(pg)
