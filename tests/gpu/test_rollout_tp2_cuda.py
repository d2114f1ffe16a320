"""Rollout TP 2 on GPUs (issue 15, item 4): `roles.start_rollout` starts one engine whose actor holds no
GPU while vLLM's Ray executor places its two TP workers on the engine's two placement-group bundles
(colocated: half of each GPU, the other half being the trainer's; split: whole GPUs after the trainer's);
the engine generates, and its log-probs match HF's in fp32. Needs 2 GPUs (split: 3). CPU twins:
tests/e2e/orchestration/test_rollout_placement.py (the placement, fake GPUs) and
tests/e2e/trainer/test_trainer_e2e.py (a colocated TP-2 engine in a training run)."""

import pytest
import torch

from megarl.cluster import ray_node, roles
from megarl.config.batch_plan import plan_batches
from megarl.config.loader import build_config
from megarl.models.tiny import make_tiny_model
from megarl.orchestration import placement
from megarl.orchestration.cluster import init_ray, shutdown_ray
from megarl.orchestration.placement import BundleSpec, create_placement_group
from megarl.parallel.device import worker_env
from megarl.workers.rollout import SamplingConfig
from tests.e2e.rollout.rollout_reference import PROMPTS, hf_logprobs, load_hf

pytestmark = pytest.mark.gpu

PLACEMENTS = {"colocated": {"gpus_per_node": 2}, "split": {"mode": "split", "gpus_per_node": 3, "rollout_gpus": 2}}
"""Colocated on 2 GPUs (the seeds' layout, narrowed to one engine); split: 1 training GPU, 2 rollout."""
TOLERANCE = 2e-3
"""fp32 on CUDA against fp32 on CPU: kernels differ in summation order (and may use TF32)."""


def _used_gib(device: int) -> float:
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


@pytest.mark.parametrize("mode", PLACEMENTS)
def test_a_tp2_engine_spans_two_gpu_bundles(tmp_path, mode, memory_phase):
    needed = PLACEMENTS[mode]["gpus_per_node"]
    if torch.cuda.device_count() < needed:
        pytest.skip(f"{mode} rollout TP 2 needs {needed} GPUs, {torch.cuda.device_count()} visible")
    model_dir = make_tiny_model(tmp_path / "qwen2", "qwen2", initializer_range=0.2)
    problems = []
    config = build_config(
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "trainer": {"device": "cuda"},
            "rollout": {"tensor_model_parallel_size": 2, "gpu_memory_utilization": 0.2},
            "placement": PLACEMENTS[mode],
        },
        problems,
    )
    assert problems == []
    plan = plan_batches(config)
    before = [_used_gib(gpu) for gpu in range(torch.cuda.device_count())]
    init_ray()
    try:
        bundles, cpus = ray_node.device_bundles(plan)
        bundle = BundleSpec(cpus=cpus, gpus=1.0)  # as roles.start_roles on CUDA
        pg = create_placement_group("rollout-tp2", bundles, bundle)
        share = roles.process_share(bundle, plan.processes_per_train_gpu)
        with memory_phase("start"):
            group = roles.start_rollout(
                config,
                plan,
                pg,
                placement.gpu_slots(pg, bundles),
                share.gpus if plan.colocated else bundle.gpus,
                worker_env("cuda"),
                False,  # compiled, as `rollout.enforce_eager: auto` on GPU
            )
        try:
            assert group.world_size == 1
            # Each TP worker holds memory on a GPU of its own (which ids Ray gave the bundles is its choice).
            grown = [gpu for gpu, used in enumerate(before) if _used_gib(gpu) > used + 0.05]
            assert len(grown) >= 2, (before, grown)
            with memory_phase("generate"):
                [outputs] = group.call_all("generate", PROMPTS, SamplingConfig(n=2, max_new_tokens=6, seed=0))
            hf = load_hf(model_dir)
            for prompt, output in zip(PROMPTS, outputs):
                for tokens, logprobs in zip(output.response_token_ids, output.response_logprobs):
                    expected = hf_logprobs(hf, prompt + tokens)[len(prompt) - 1 :]
                    torch.testing.assert_close(logprobs, expected, atol=TOLERANCE, rtol=0)
            group.call_all("shutdown")
        finally:
            group.kill()
    finally:
        shutdown_ray()
