"""bf16 training on CPU, for real: the tiny actor trains in bf16 with fp32 main parameters, fp32
main gradients and fp32 Adam states, through both of megatron's mixed-precision optimizers
(`Float16OptimizerWithFloat16Params` and the `DistributedOptimizer`), and a checkpoint of it
restores the same state.

One world of 2 ranks (DP 2) builds both actors. What megatron-core 0.16.1 does and this mirrors:
`optimizer/__init__.py:get_megatron_optimizer` picks the mixed-precision optimizer for
`OptimizerConfig.bf16`; `optimizer/optimizer.py:Float16OptimizerWithFloat16Params` keeps
`fp32_from_float16_groups`; `optimizer/distrib_optimizer.py:DistributedOptimizer` keeps
`shard_fp32_from_float16_groups`; `distributed/distributed_data_parallel.py` gives every parameter a
`main_grad` in the dtype `grad_reduce_in_fp32` picks.
"""

import math

import pytest
import torch
from worker_batches import ragged_batch

from megarl.parallel.spawn import run_distributed

STEPS = 4
LR = 1e-3


def _inner(optimizer) -> list:
    """megatron's optimizers inside its `ChainedOptimizer` (one per parameter-group set)."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _main_params(optimizer) -> list[torch.Tensor]:
    """The fp32 main parameters megatron's mixed-precision optimizer updates (this rank's shards)."""
    return [
        param
        for inner in _inner(optimizer)
        for group in getattr(inner, "shard_fp32_from_float16_groups", None) or inner.fp32_from_float16_groups
        for param in group
    ]


def _adam_states(optimizer) -> list[torch.Tensor]:
    return [
        tensor
        for inner in _inner(optimizer)
        for state in inner.optimizer.state.values()
        for tensor in state.values()
        if torch.is_tensor(tensor) and tensor.dim() > 0  # not Adam's step counter
    ]


def _train(model_dir, groups, distributed_optimizer, checkpoint_dir):
    """STEPS bf16 updates of the tiny actor; dtypes, progress, and (with `checkpoint_dir`) a round trip."""
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.checkpoint import load_checkpoint, save_checkpoint

    settings = ModelConfig(dtype="bfloat16", transformer_impl="auto")
    optim = OptimizerConfig(lr=LR, use_distributed_optimizer=distributed_optimizer, weight_decay=0.0)
    actor = MegatronActor.from_hf(model_dir, groups, optim=optim, model=settings)
    ddp, optimizer = actor.engine.model, actor.engine.optimizer
    out = dict(
        optimizer_classes={type(inner).__name__ for inner in _inner(optimizer)},
        param_dtypes={str(p.dtype) for p in ddp.module.parameters()},
        main_grad_dtypes={str(p.main_grad.dtype) for p in ddp.module.parameters()},
        transformer_impl=ddp.config.transformer_impl,
    )
    batch = ragged_batch()
    share = len(batch) // groups.dp_size
    local = batch.select(slice(groups.dp_rank * share, (groups.dp_rank + 1) * share))
    local.advantages = torch.ones(len(local), local.response_length)  # every response token gets likelier
    mask = local.response_mask
    losses, grad_norms, mean_log_probs = [], [], []
    for _ in range(STEPS):
        # On-policy steps (old = current log-probs): the ratio starts at 1, never clipped away.
        local.old_log_probs, _ = actor.compute_log_prob(local, micro_batch_size=share)
        mean_log_probs.append(float(local.old_log_probs[mask].mean()))
        metrics = actor.update_policy(local, PolicyLoss(ActorConfig()), mini_batch_size=share, micro_batch_size=2)
        losses.append(metrics["loss"])
        grad_norms.append(metrics["grad_norm"])
    log_probs, entropy = actor.compute_log_prob(local, micro_batch_size=share)
    mean_log_probs.append(float(log_probs[mask].mean()))
    out.update(losses=losses, grad_norms=grad_norms, mean_log_probs=mean_log_probs)
    out["log_prob_dtypes"] = {str(log_probs.dtype), str(entropy.dtype)}

    main = _main_params(optimizer)
    out["main_param_dtypes"] = {str(p.dtype) for p in main}
    out["adam_state_dtypes"] = {str(t.dtype) for t in _adam_states(optimizer)}
    out["main_grad_buffer_dtypes"] = {str(b.grad_data.dtype) for b in ddp.buffers}
    if not distributed_optimizer:
        # Many updates are below bf16 resolution: the fp32 main copy keeps them, the model is its rounding.
        pairs = [
            (main_param, model_param)
            for inner in _inner(optimizer)
            for mains, models in zip(inner.fp32_from_float16_groups, inner.float16_groups)
            for main_param, model_param in zip(mains, models)
        ]
        out["main_differs_from_model"] = any(not torch.equal(m, p.float()) for m, p in pairs)
        out["model_is_rounded_main"] = all(torch.equal(m.to(torch.bfloat16), p) for m, p in pairs)

    if checkpoint_dir is not None:
        path = save_checkpoint(checkpoint_dir, STEPS, groups, **_states(actor), extra={})
        fresh = MegatronActor.from_hf(model_dir, groups, optim=optim, model=settings)
        load_checkpoint(path, groups, **_states(fresh))
        out["restored_model"] = all(
            torch.equal(a, b) for a, b in zip(ddp.module.parameters(), fresh.engine.model.module.parameters())
        )
        out["restored_main"] = all(torch.equal(a, b) for a, b in zip(main, _main_params(fresh.engine.optimizer)))
        out["restored_adam"] = all(
            torch.equal(a, b) for a, b in zip(_adam_states(optimizer), _adam_states(fresh.engine.optimizer))
        )
    return out


def _states(actor) -> dict:
    engine = actor.engine
    return dict(
        models={"actor": [engine.model]}, optimizers={"actor": engine.optimizer}, schedulers={"actor": engine.scheduler}
    )


def _rank_main(model_dir, checkpoint_dir):
    from megarl.parallel.distributed import initialize_model_parallel

    groups = initialize_model_parallel(1, 1, seed=0)
    return {
        "float16_optimizer": _train(model_dir, groups, False, checkpoint_dir),
        "distributed_optimizer": _train(model_dir, groups, True, None),
    }


@pytest.fixture(scope="module")
def bf16_ranks(tiny_qwen2, tmp_path_factory):
    return run_distributed(_rank_main, 2, str(tiny_qwen2), str(tmp_path_factory.mktemp("bf16_ckpt")), timeout_s=240)


@pytest.mark.parametrize("kind", ["float16_optimizer", "distributed_optimizer"])
def test_bf16_model_trains_with_fp32_main_params_grads_and_states(bf16_ranks, kind):
    expected_class = {
        "float16_optimizer": "Float16OptimizerWithFloat16Params",
        "distributed_optimizer": "DistributedOptimizer",
    }
    for rank in bf16_ranks:
        out = rank[kind]
        assert out["optimizer_classes"] == {expected_class[kind]}
        assert out["transformer_impl"] == "local"  # auto on a CPU process
        assert out["param_dtypes"] == {"torch.bfloat16"}
        assert out["main_grad_dtypes"] == {"torch.float32"} and out["main_grad_buffer_dtypes"] == {"torch.float32"}
        assert out["main_param_dtypes"] == {"torch.float32"} and out["adam_state_dtypes"] == {"torch.float32"}
        assert out["log_prob_dtypes"] == {"torch.float32"}  # computed from upcast logits (workers/logprobs.py)
        assert all(math.isfinite(x) for x in out["losses"] + out["grad_norms"] + out["mean_log_probs"])
        assert all(norm > 0 for norm in out["grad_norms"])
        # Positive advantages on every token: the trained tokens get likelier at every step.
        log_probs = out["mean_log_probs"]
        assert all(after > before for before, after in zip(log_probs, log_probs[1:])), log_probs
    assert bf16_ranks[0][kind]["losses"] == bf16_ranks[1][kind]["losses"]  # reduced over DP


def test_fp32_main_params_hold_more_than_the_bf16_model(bf16_ranks):
    for rank in bf16_ranks:
        assert rank["float16_optimizer"]["main_differs_from_model"]
        assert rank["float16_optimizer"]["model_is_rounded_main"]


def test_bf16_checkpoint_restores_model_main_params_and_adam_states(bf16_ranks):
    for rank in bf16_ranks:
        out = rank["float16_optimizer"]
        assert out["restored_model"] and out["restored_main"] and out["restored_adam"]
