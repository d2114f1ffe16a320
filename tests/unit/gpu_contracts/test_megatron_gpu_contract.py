"""megarl's calls into megatron-core 0.16.1's mixed-precision and offload APIs fit the installed
package. The mixed-precision path also runs on CPU (tests/distributed/workers/test_mixed_precision.py),
and so does the gradient-buffer offload (the e2e hand-over test); the parameter and optimizer offloads
are GPU-only in megarl (`TrainEngine.offload_params` / `onload` skip them on CPU), so only these checks
guard them here."""

import pytest
from call_sites import assert_fits, call_sites, dataclass_fields
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.unit

TRAIN = "workers/megatron_train.py"


@pytest.mark.parametrize(
    "path, cls, name",
    [
        # megatron/core/optimizer/optimizer_config.py; megatron_train imports it under this name (its
        # `OptimizerConfig` is the role's `optim` section, megarl.config.roles)
        (TRAIN, OptimizerConfig, "MegatronOptimizerConfig"),
        # megatron/core/distributed/distributed_data_parallel_config.py
        (TRAIN, DistributedDataParallelConfig, "DistributedDataParallelConfig"),
        (
            "models/architectures.py",
            TransformerConfig,
            "TransformerConfig",
        ),  # megatron/core/transformer/transformer_config.py
    ],
)
def test_config_keywords_are_fields(path, cls, name):
    for site in call_sites(path, name):
        unknown = sorted(set(site.keywords) - dataclass_fields(cls))
        assert not unknown, f"{site.where}: {cls.__name__} has no fields {unknown}"


def test_mixed_precision_fields_exist():
    """bf16 training: TransformerConfig/OptimizerConfig `bf16` + `params_dtype`, DDP `grad_reduce_in_fp32`."""
    assert {"bf16", "params_dtype"} <= dataclass_fields(TransformerConfig)
    assert {"bf16", "params_dtype", "optimizer_cpu_offload"} <= dataclass_fields(OptimizerConfig)
    assert "grad_reduce_in_fp32" in dataclass_fields(DistributedDataParallelConfig)


def test_buffer_offload_calls_fit():
    """megatron/core/distributed/param_and_grad_buffer.py `_ParamAndGradBuffer.offload_to_cpu` /
    `reload_from_cpu(move_params, move_grads)`: megarl moves the parameters alone (after the sync)."""
    buffer_calls = [site for site in call_sites(TRAIN, "offload_to_cpu") if site.keywords]
    assert buffer_calls, "megarl offloads the parameters with offload_to_cpu(move_params=..., move_grads=...)"
    assert_fits(buffer_calls, _ParamAndGradBuffer.offload_to_cpu, bound=True)
    assert_fits(call_sites(TRAIN, "reload_from_cpu"), _ParamAndGradBuffer.reload_from_cpu, bound=True)


def test_grad_buffer_offload_calls_fit():
    """megatron/core/distributed/distributed_data_parallel.py `DistributedDataParallel.offload_grad_buffers`
    / `restore_grad_buffers` free and bring back (zeroed) the gradient buffers after the update."""
    assert_fits(call_sites(TRAIN, "offload_grad_buffers"), DistributedDataParallel.offload_grad_buffers, bound=True)
    assert_fits(call_sites(TRAIN, "restore_grad_buffers"), DistributedDataParallel.restore_grad_buffers, bound=True)
    assert call_sites(TRAIN, "offload_grad_buffers") and call_sites(TRAIN, "restore_grad_buffers")


@pytest.mark.parametrize(
    "optimizer", [Float16OptimizerWithFloat16Params, DistributedOptimizer, FP32Optimizer, ChainedOptimizer]
)
def test_optimizer_offload_calls_fit(optimizer):
    """Every optimizer `get_megatron_optimizer` may return (megatron/core/optimizer/__init__.py) has
    `offload_to_cpu()` / `restore_from_cpu()` (megatron/core/optimizer/optimizer.py, distrib_optimizer.py)."""
    optimizer_calls = [site for site in call_sites(TRAIN, "offload_to_cpu") if not site.keywords]
    assert optimizer_calls, "megarl offloads the optimizer with a no-argument offload_to_cpu()"
    assert_fits(optimizer_calls, optimizer.offload_to_cpu, bound=True)
    assert_fits(call_sites(TRAIN, "restore_from_cpu"), optimizer.restore_from_cpu, bound=True)
