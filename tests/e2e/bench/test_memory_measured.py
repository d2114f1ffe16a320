"""The memory estimate's parameter + gradient + optimizer bytes against what a real Megatron actor
allocates on CPU: its parameters, DDP's grad buffer and the optimizer's states after one step."""

from __future__ import annotations

import pytest
import torch

from megarl.config.memory import ModelShape, state_bytes
from megarl.config.roles import ParallelConfig
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

# DDP pads its buffers (to a multiple of the DP size × 128 elements for the distributed optimizer),
# which the estimate leaves out: a few hundred elements on ~10^5.
TOLERANCE = 0.02


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(model_dir: str, tp: int, distributed_optimizer: bool) -> tuple[int, int, int]:
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss, PolicyLossSettings
    from megarl.workers.batch import PolicyBatch
    from megarl.workers.megatron_train import OptimSettings

    groups = initialize_model_parallel(tp, 1, seed=0)
    actor = MegatronActor.from_hf(model_dir, groups, optim=OptimSettings(lr=1e-3, use_distributed_optimizer=distributed_optimizer))
    rows, prompt, response = 2, 4, 3
    generator = torch.Generator().manual_seed(0)  # the same batch on every rank
    batch = PolicyBatch(
        prompts=torch.randint(3, 90, (rows, prompt), generator=generator), prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
        responses=torch.randint(3, 90, (rows, response), generator=generator),
        response_mask=torch.ones(rows, response, dtype=torch.bool),
        old_log_probs=torch.full((rows, response), -4.0), advantages=torch.ones(rows, response),
    )
    actor.update_policy(batch, PolicyLoss(PolicyLossSettings()), mini_batch_size=rows, micro_batch_size=rows)
    ddp = actor.engine.model
    params = _tensor_bytes(ddp.module.parameters())
    grads = _tensor_bytes(buffer.grad_data for buffer in ddp.buffers)
    states = [
        tensor
        for inner in _torch_optimizers(actor.engine.optimizer)
        for state in inner.state.values()
        for tensor in state.values()
        if torch.is_tensor(tensor) and tensor.dim() > 0  # Adam's step counter is a scalar, not a state of the size of the model
    ]
    return params, grads, _tensor_bytes(states)


def _torch_optimizers(optimizer):
    """The torch optimizers inside megatron's (Chained)optimizer wrappers."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in inner]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("memory"), "qwen2"))


@pytest.mark.parametrize("tp, distributed_optimizer", [(2, False), (1, True)], ids=["tp2", "dp2-distributed-optimizer"])
def test_state_bytes_match_a_cpu_actor(model_dir, tp, distributed_optimizer):
    measured = run_distributed(_measure, 2, model_dir, tp, distributed_optimizer, timeout_s=240)
    shape = ModelShape.of(model_dir)
    expected = state_bytes(shape, ParallelConfig(tensor_model_parallel_size=tp), 2 // tp, "float32",
                           distributed_optimizer=distributed_optimizer, trained=True)
    for rank, got in enumerate(measured):
        for part, want, have in zip(("parameters", "gradients", "optimizer"), expected, got):
            assert have == pytest.approx(want, rel=TOLERANCE), f"rank {rank} {part}: estimate {want} B, measured {have} B"
