"""The memory estimate's parameter + gradient + optimizer bytes against what a real Megatron actor
allocates on CPU, in fp32 and in bf16: its parameters, DDP's grad buffer, and the optimizer's
states after one step plus its fp32 main parameters (bf16 only: with fp32 parameters megatron's
optimizer updates the model's own)."""

from __future__ import annotations

import pytest
import torch

from megarl.config.memory import state_bytes
from megarl.config.roles import ParallelConfig
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

# DDP pads its buffers (to a multiple of the DP size × 128 elements for the distributed optimizer),
# which the estimate leaves out: a few hundred elements on ~10^5.
TOLERANCE = 0.02
DTYPES = ("float32", "bfloat16")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(model_dir: str, tp: int, distributed_optimizer: bool) -> dict[str, tuple[int, int, int]]:
    from megarl.parallel.distributed import initialize_model_parallel

    groups = initialize_model_parallel(tp, 1, seed=0)
    return {dtype: _measure_actor(model_dir, groups, distributed_optimizer, dtype) for dtype in DTYPES}


def _measure_actor(model_dir: str, groups, distributed_optimizer: bool, dtype: str) -> tuple[int, int, int]:
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.batch import PolicyBatch

    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=1e-3, use_distributed_optimizer=distributed_optimizer, weight_decay=0.0),
        model=ModelConfig(dtype=dtype, transformer_impl="local"),
    )
    rows, prompt, response = 2, 4, 3
    generator = torch.Generator().manual_seed(0)  # the same batch on every rank
    batch = PolicyBatch(
        prompts=torch.randint(3, 90, (rows, prompt), generator=generator),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
        responses=torch.randint(3, 90, (rows, response), generator=generator),
        response_mask=torch.ones(rows, response, dtype=torch.bool),
        old_log_probs=torch.full((rows, response), -4.0),
        advantages=torch.ones(rows, response),
    )
    actor.update_policy(batch, PolicyLoss(ActorConfig()), mini_batch_size=rows, micro_batch_size=rows)
    ddp = actor.engine.model
    params = _tensor_bytes(ddp.module.parameters())
    grads = _tensor_bytes(buffer.grad_data for buffer in ddp.buffers)
    megatron_optimizers = getattr(actor.engine.optimizer, "chained_optimizers", [actor.engine.optimizer])
    states = [
        tensor
        for inner in megatron_optimizers
        for state in inner.optimizer.state.values()
        for tensor in state.values()
        if torch.is_tensor(tensor)
        and tensor.dim() > 0  # Adam's step counter is a scalar, not a state of the size of the model
    ]
    # The fp32 main parameters of mixed precision (Float16OptimizerWithFloat16Params /
    # DistributedOptimizer); with fp32 parameters there are none apart from the model's own.
    main_groups = [
        getattr(inner, "shard_fp32_from_float16_groups", None) or getattr(inner, "fp32_from_float16_groups", [])
        for inner in megatron_optimizers
    ]
    main_params = [param for groups in main_groups for group in groups for param in group]
    return params, grads, _tensor_bytes(states) + _tensor_bytes(main_params)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("memory"), "qwen2"))


@pytest.mark.parametrize("tp, distributed_optimizer", [(2, False), (1, True)], ids=["tp2", "dp2-distributed-optimizer"])
def test_state_bytes_match_a_cpu_actor(model_dir, tp, distributed_optimizer):
    measured = run_distributed(_measure, 2, model_dir, tp, distributed_optimizer, timeout_s=240)
    dims = read_model_dims(model_dir)
    for dtype in DTYPES:
        expected = state_bytes(
            dims,
            ParallelConfig(tensor_model_parallel_size=tp),
            2 // tp,
            dtype,
            distributed_optimizer=distributed_optimizer,
            trained=True,
        )
        for rank, by_dtype in enumerate(measured):
            got = by_dtype[dtype]
            print(f"{dtype} rank {rank}: measured (params, grads, optimizer) {got} B, estimate {expected} B")
            for part, want, have in zip(("parameters", "gradients", "optimizer"), expected, got):
                assert have == pytest.approx(want, rel=TOLERANCE), (
                    f"{dtype} rank {rank} {part}: estimate {want} B, measured {have} B"
                )
