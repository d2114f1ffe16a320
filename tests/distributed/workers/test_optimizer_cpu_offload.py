"""Optimizer CPU offload (`*.optim.cpu_offload`, `cpu_offload_fraction`): the actor's megatron optimizer is
megatron-core's HybridDeviceOptimizer with the configured fraction, it splits the state between its host
and its device optimizer as that fraction says, and one update leaves the fp32 main parameters and the
model's bf16 parameters what the distributed optimizer without offload leaves (DP 2 on gloo).

On CPU host memory is the device: the offloaded state is copied host to host (`megarl.parallel.
cpu_runtime`), so nothing is saved here; what is proven is megarl's wiring and megatron's hybrid code path
(the split, the gradient copies to the host copies, the host step, the copy back). bfloat16 parameters, as
validate requires: megatron-core 0.16.1 cannot offload the state of float32 ones (`check_cpu_offload`).
A run resumed from a checkpoint continues exactly (`megarl.workers.checkpoint`: the hybrid optimizer's
state for the load, Adam's per-parameter steps).
"""

import pytest
import torch
from worker_batches import ragged_batch

from megarl.parallel.spawn import run_distributed

FRACTIONS = (0.5, 1.0)
TOLERANCE = 1e-5
DP = 2


def _inner(optimizer):
    """The DistributedOptimizer inside megatron's ChainedOptimizer (one parameter group kind here)."""
    [inner] = optimizer.chained_optimizers
    return inner


def _main_params(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(bf16 parameter shard, its fp32 main parameter) pairs of this DP rank, in megatron's order."""
    inner = _inner(optimizer)
    shards = [shard for group in inner.shard_float16_groups for shard in group]
    hybrid = inner.optimizer
    if hasattr(hybrid, "param_to_fp32_param"):
        mains = [hybrid.param_to_fp32_param[shard] for shard in shards]
    else:
        mains = [main for group in inner.shard_fp32_from_float16_groups for main in group]
    return [(shard.detach().clone(), main.detach().clone()) for shard, main in zip(shards, mains)]


def _rank_main(model_dir, old_log_probs, advantages):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    groups = initialize_model_parallel(1, 1, seed=0)
    batch = ragged_batch().split(DP)[groups.dp_rank]
    batch.old_log_probs, batch.advantages = old_log_probs.split(4)[groups.dp_rank], advantages.split(4)[groups.dp_rank]
    out = {}
    for fraction in (None, *FRACTIONS):
        optim = OptimizerConfig(
            lr=0.01,
            use_distributed_optimizer=True,
            cpu_offload=fraction is not None,
            cpu_offload_fraction=fraction or 1.0,
            weight_decay=0.0,
        )
        actor = MegatronActor.from_hf(
            model_dir, groups, optim=optim, model=ModelConfig(dtype="bfloat16", transformer_impl="local")
        )
        optimizer = actor.engine.optimizer
        hybrid = _inner(optimizer).optimizer
        built = dict(hybrid=isinstance(hybrid, HybridDeviceOptimizer))
        if built["hybrid"]:
            device_elements = sum(p.numel() for group in hybrid.param_groups for p in group["params"])
            built.update(
                offload_fraction=hybrid.offload_fraction,
                host_share=sum(p.numel() for p in hybrid.gpu_params_map_cpu_copy) / device_elements,
                host_optimizers=len(hybrid.cpu_optimizers),
                device_optimizer=hybrid.gpu_optimizer is not None,
            )
        metrics = actor.update_policy(batch, PolicyLoss(ActorConfig()), mini_batch_size=len(batch), micro_batch_size=2)
        out[fraction] = dict(
            built=built,
            grad_norm=metrics["grad_norm"],
            main_params=_main_params(optimizer),
            params={n: p.detach().float() for n, p in actor.engine.model.module.named_parameters()},
        )
    return out


@pytest.fixture(scope="module")
def ranks(tiny_qwen2, hf_reference):
    gen = torch.Generator().manual_seed(7)
    old_log_probs = hf_reference[0] + 0.05 * torch.randn(hf_reference[0].shape, generator=gen)
    advantages = torch.randn(old_log_probs.shape, generator=gen)
    return run_distributed(_rank_main, DP, str(tiny_qwen2), old_log_probs, advantages)


def test_the_optimizer_is_the_hybrid_one_with_the_configured_fraction(ranks):
    for rank in ranks:
        assert rank[None]["built"] == dict(hybrid=False)
        for fraction in FRACTIONS:
            built = rank[fraction]["built"]
            assert built["hybrid"] and built["offload_fraction"] == fraction
            # Whole parameters move until the fraction is reached (HybridDeviceOptimizer's own rule).
            assert built["host_share"] >= fraction and built["host_optimizers"] >= 1
            assert built["device_optimizer"] == (fraction < 1.0)
        assert rank[0.5]["built"]["host_share"] < 1.0


def test_one_update_equals_the_update_without_offload(ranks):
    for rank in ranks:
        reference = rank[None]
        assert reference["grad_norm"] > 0
        for fraction in FRACTIONS:
            run = rank[fraction]
            assert run["grad_norm"] == pytest.approx(reference["grad_norm"], rel=TOLERANCE)
            assert len(run["main_params"]) == len(reference["main_params"])
            for (shard, main), (_, reference_main) in zip(run["main_params"], reference["main_params"]):
                diff = float((main - reference_main).abs().max())
                assert diff <= TOLERANCE, f"fraction {fraction}: fp32 main parameters differ by {diff:.2e}"
                # The host's update came back into the model's bf16 parameters.
                assert torch.equal(shard, main.to(torch.bfloat16))
            for name, param in reference["params"].items():
                diff = float((run["params"][name] - param).abs().max())
                assert diff <= TOLERANCE, f"fraction {fraction}: parameter {name} differs by {diff:.2e}"


def _resume_main(model_dir, root, advantages):
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.checkpoint import load_checkpoint, save_checkpoint

    groups = initialize_model_parallel(1, 1, seed=0)
    batch = ragged_batch().split(DP)[groups.dp_rank]
    batch.advantages = advantages.split(4)[groups.dp_rank]
    optim = OptimizerConfig(
        lr=0.01, use_distributed_optimizer=True, cpu_offload=True, cpu_offload_fraction=0.5, weight_decay=0.0
    )
    loss_fn = PolicyLoss(ActorConfig())

    def build():
        return MegatronActor.from_hf(
            model_dir, groups, optim=optim, model=ModelConfig(dtype="bfloat16", transformer_impl="local")
        )

    def parts(actor):
        engine = actor.engine
        return dict(
            models={"actor": [engine.model]},
            optimizers={"actor": engine.optimizer},
            schedulers={"actor": engine.scheduler},
        )

    def step(actor):
        return actor.update_policy(batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=2)["grad_norm"]

    running = build()
    step(running)
    path = save_checkpoint(root, 1, groups, **parts(running), extra={})
    resumed = build()
    load_checkpoint(path, groups, **parts(resumed))
    norms = step(running), step(resumed)
    return norms, [_main_params(actor.engine.optimizer) for actor in (running, resumed)]


def test_a_resumed_run_continues_as_the_run_that_saved(tiny_qwen2, tmp_path):
    advantages = torch.randn(ragged_batch().response_mask.shape, generator=torch.Generator().manual_seed(9))
    for (running_norm, resumed_norm), (running, resumed) in run_distributed(
        _resume_main, DP, str(tiny_qwen2), str(tmp_path), advantages
    ):
        assert resumed_norm == pytest.approx(running_norm, rel=TOLERANCE)
        for (shard, main), (resumed_shard, resumed_main) in zip(running, resumed):
            assert float((resumed_main - main).abs().max()) <= TOLERANCE
            assert torch.equal(resumed_shard, shard)
