"""The memory estimate as `megarl validate` prints it: `format_estimate` (the table, GiB per GPU per role,
and the verdict) and `memory_report` (the estimate of a validated recipe, or why there is none, and whether it
fits)."""

from __future__ import annotations

from megarl.config.batch_plan import plan_batches
from megarl.config.config import Config
from megarl.config.memory import GIB, MemoryEstimate, estimate_memory
from megarl.config.model_facts import ModelFactsError, load_model_dims


def format_estimate(estimate: MemoryEstimate) -> str:
    """The table `megarl validate` prints, GiB per GPU, and the verdict."""
    lines = [*estimate.runs, "role     params   grads   optim   activ   other   total  (GiB per GPU)"]
    for r in estimate.roles:
        cells = [r.parameters, r.gradients, r.optimizer, r.activations, r.other, r.total]
        lines.append(f"{r.role:<8}" + "".join(f"{c / GIB:8.2f}" for c in cells))
    verdict = "fits" if estimate.fits else "does not fit"
    runtime = (
        f" + {estimate.runtime_bytes / GIB:.1f} GiB of CUDA contexts and NCCL buffers" if estimate.runtime_bytes else ""
    )
    margin = (
        f"{estimate.spare_bytes / GIB:.1f} GiB to spare (keeps {estimate.margin_bytes / GIB:.0f}): "
        if estimate.margin_bytes
        else ""
    )
    lines.append(
        f"peak {estimate.peak_bytes / GIB:.1f} GiB per GPU ({estimate.peak_phase}){runtime} of "
        f"{estimate.gpu_memory_bytes / GIB:.0f} GiB: {margin}{verdict}"
    )
    return "\n".join(lines)


def memory_report(config: Config, gpu_memory_gib: float) -> tuple[str, bool]:
    """`format_estimate` for a validated `config`, or one line saying why there is none (the model's
    shape could not be read); and whether the estimate fits its GPUs (True when there is none)."""
    try:
        estimate = _estimate(config, gpu_memory_gib)
    except ModelFactsError as error:
        return f"none: {error.why}", True
    return format_estimate(estimate), estimate.fits


def _estimate(config: Config, gpu_memory_gib: float) -> MemoryEstimate:
    """The estimate of a validated `config`; raises `ModelFactsError` when the model's shape cannot be read."""
    dims, _ = load_model_dims(config.model.path)
    plan = plan_batches(config)
    return estimate_memory(
        config,
        dims,
        train_gpus=plan.train_gpus,
        gpu_memory_gib=gpu_memory_gib,
        on_gpu=config.trainer.device != "cpu",
        processes_per_train_gpu=plan.processes_per_train_gpu,
    )
