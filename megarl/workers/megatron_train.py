"""What the actor and the critic share: Megatron DDP + optimizer + LR schedule, one optimizer step
over micro-batches through megatron's pipeline schedule, and a forward-only pass.

Loss normalisation. A worker's loss function returns each micro-batch's share of the step loss,
already divided by the *global* normaliser of the optimizer step (token or sequence count summed
over all micro-batches and DP ranks, all-reduced before the step), so that

    step loss = sum over micro-batches and DP ranks of the returned losses.

megatron's schedule divides each micro-batch loss by the number of micro-batches, and Megatron DDP
averages gradients over DP ranks; `TrainEngine.train_step` multiplies the loss by
`num_micro_batches * dp_size` before handing it to the schedule, which undoes both. The result does
not depend on how a step is cut into micro-batches or DP ranks.

Non-finite steps. If the step loss or any gradient is NaN/Inf on any rank, the optimizer step and
the LR schedule step are skipped on every rank (weights unchanged) and counted.

Mixed precision (bf16 parameters), the way megatron-core does it; the model's `TransformerConfig`
(`bf16`, `params_dtype`) is the one source:
- DDP accumulates and reduces gradients in an fp32 buffer (`DistributedDataParallelConfig.
  grad_reduce_in_fp32`; each parameter's `main_grad` is a view of it), as megatron's training
  arguments force for bf16 (`accumulate_allreduce_grads_in_fp32`);
- the optimizer keeps fp32 main parameters and fp32 Adam states and copies the updated main
  parameters back into the bf16 model (megatron's `OptimizerConfig.bf16` + `params_dtype`:
  `get_megatron_optimizer` builds `Float16OptimizerWithFloat16Params`, or the `DistributedOptimizer`
  with fp32 main-parameter shards); bf16 needs no loss scale.
With fp32 parameters the same DDP buffer is fp32 and megatron's `FP32Optimizer` updates the model's
own parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model
from torch import Tensor

from megarl.algorithms.losses import agg_loss_normalizer
from megarl.config.roles import MoeConfig, OffloadConfig, OptimizerConfig, RecomputeConfig
from megarl.config.sections import ModelConfig
from megarl.models.architectures import build_model_chunks, resolve_transformer_impl, takes_thd
from megarl.models.checkpoint import load_hf_weights
from megarl.models.hf_config import read_model_dims
from megarl.models.model_options import TORCH_DTYPES
from megarl.parallel.device import uses_cuda
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.batch import PolicyBatch
from megarl.workers.context_parallel import split_for_context_parallel
from megarl.workers.memory_stats import empty_cache
from megarl.workers.micro_batches import MicroBatch, cut_micro_batches, pad_sequence
from megarl.workers.packing import TokenBudget
from megarl.workers.thd import cut_thd_micro_batches


def megatron_optimizer_config(optim: OptimizerConfig, model_config: TransformerConfig) -> MegatronOptimizerConfig:
    """megatron's optimizer config from a role's `optim` section, in the precision of the model
    (`model_config`, its `TransformerConfig`): bf16 parameters get fp32 main parameters (see the module
    docstring).

    `optim.cpu_offload`: megatron's `HybridDeviceOptimizer` holds the optimizer state of
    `cpu_offload_fraction` of the parameters on the host. megatron-core builds it for
    `optimizer_cpu_offload` (megatron/core/optimizer/__init__.py) and steps it through the precision-aware
    path of the distributed optimizer, whose main parameters are then the HybridDeviceOptimizer's own
    fp32 copies: Megatron-LM's arguments refuse `--optimizer-cpu-offload` without
    `--use-precision-aware-optimizer` (which in turn needs the distributed optimizer and adam:
    megatron's `OptimizerConfig.__post_init__`)."""
    return MegatronOptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        optimizer_cpu_offload=optim.cpu_offload,
        optimizer_offload_fraction=optim.cpu_offload_fraction if optim.cpu_offload else 0.0,
        use_precision_aware_optimizer=optim.cpu_offload,
        bf16=model_config.bf16,
        params_dtype=model_config.params_dtype,
    )


def wrap_for_training(
    chunks: Sequence[torch.nn.Module], optim: OptimizerConfig, groups: ProcessGroups
) -> list[DistributedDataParallel]:
    """Megatron DDP around each model chunk (one per virtual stage), with the model config hooks megatron's
    schedules call. Only the first chunk's DDP buckets its gradients, as Megatron-LM's `get_model` does:
    with several chunks, bucketing in the others would start their DP reductions out of schedule order."""
    ddps = [
        DistributedDataParallel(
            chunk.config,
            # fp32 main grads whatever the parameter dtype (a no-op for fp32 parameters).
            DistributedDataParallelConfig(
                use_distributed_optimizer=optim.use_distributed_optimizer, grad_reduce_in_fp32=True
            ),
            chunk,
            disable_bucketing=index > 0,
            pg_collection=groups.collection,
        )
        for index, chunk in enumerate(chunks)
    ]
    for ddp in ddps:
        # DP all-reduce, tied-embedding all-reduce across PP stages, at the end of each backward pass.
        ddp.config.finalize_model_grads_func = finalize_model_grads
        # The interleaved schedule enters every chunk's no_sync; the others take one.
        ddp.config.no_sync_func = [chunk.no_sync for chunk in ddps] if len(ddps) > 1 else ddps[0].no_sync
    return ddps


def lr_decay_end(optim: OptimizerConfig, lr_decay_steps: int | None) -> int:
    """The step (counted from 0, warm-up included) at which the decay reaches `optim.min_lr`:
    `lr_decay_steps`, past the warm-up. megatron's scheduler wants it past the warm-up even when nothing
    decays ("constant"), or when the run ends inside the warm-up."""
    if lr_decay_steps is None and optim.lr_decay_style != "constant":
        raise ValueError(
            f"lr_decay_style={optim.lr_decay_style!r} needs lr_decay_steps (the optimizer step the decay ends "
            "at: the run's optimizer steps); pass it, or use lr_decay_style='constant'"
        )
    return max(lr_decay_steps or 0, optim.lr_warmup_steps + 1)


def build_optimizer(
    ddps: list[DistributedDataParallel], optim: OptimizerConfig, lr_decay_steps: int | None, groups: ProcessGroups
) -> tuple[object, OptimizerParamScheduler]:
    """Megatron optimizer over the parameters of `ddps` (the model chunks) and its warm-up/decay scheduler
    (`lr_decay_steps` as `lr_decay_end`'s)."""
    optimizer = get_megatron_optimizer(
        megatron_optimizer_config(optim, ddps[0].config),
        ddps,
        use_gloo_process_groups=False,
        pg_collection=groups.collection,
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=lr_decay_end(optim, lr_decay_steps),
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


LossFunc = Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]
"""megatron's per-micro-batch loss callback: last-stage model output -> (loss, reported tensors)."""
ForwardStep = Callable[[torch.nn.Module, MicroBatch], tuple[Tensor, LossFunc]]
"""(model, micro-batch) -> (model output, loss callback), as megatron's `forward_step_func` minus the
iterator plumbing."""


def run_schedule(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    micro_batches: Sequence[MicroBatch],
    forward_step: ForwardStep,
    *,
    forward_only: bool,
) -> list[dict[str, Tensor]]:
    """Run `micro_batches` through megatron's schedule for the current PP size (1F1B when PP > 1; the
    interleaved 1F1B when `model` is a list of several virtual-stage chunks).

    Returns the loss callbacks' reported dicts, one per micro-batch, on the last pipeline stage;
    an empty list on the other stages.
    """

    def step(data_iterator, wrapped_model):
        return forward_step(wrapped_model, next(data_iterator))

    chunks = list(model) if isinstance(model, Sequence) else [model]
    rows, seq_length = len(micro_batches[0].input_ids), micro_batches[0].sequence_length
    if len(chunks) > 1:
        set_interleaving_group(chunks[0].config, len(micro_batches))
    return get_forward_backward_func()(
        forward_step_func=step,
        # Every chunk runs every micro-batch, in order: each reads its own iterator, as in Megatron-LM.
        data_iterator=[iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches),
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=rows,
        forward_only=forward_only,
    )


def set_interleaving_group(config: TransformerConfig, num_micro_batches: int) -> None:
    """The interleaved schedule's `microbatch_group_size_per_vp_stage` for a pass of `num_micro_batches`:
    megatron-core's `forward_backward_pipelining_with_interleaving` (pipeline_parallel/schedules.py) needs
    the group in [PP, M] and M mod group 0 or >= PP. PP (its default, the smallest bubble) when PP divides M,
    else all M in one group, so a forward pass or a packed cut of any M >= PP runs; the results are the
    same either way (only the order of the chunks' steps differs). Fewer than PP micro-batches cannot run."""
    pp = config.pipeline_model_parallel_size
    if num_micro_batches < pp:
        raise ValueError(
            f"the interleaved pipeline schedule (virtual_pipeline_model_parallel_size="
            f"{config.virtual_pipeline_model_parallel_size}) needs at least pipeline_model_parallel_size={pp} "
            f"micro-batches per pass, and this pass has {num_micro_batches}; give each rank more samples per "
            "mini-batch, smaller micro-batches, or no virtual pipeline"
        )
    config.microbatch_group_size_per_vp_stage = pp if num_micro_batches % pp == 0 else num_micro_batches


def compute_device() -> torch.device:
    """Where this process's model and collective buffers live: its CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if uses_cuda() else torch.device("cpu")


def all_reduce(tensor: Tensor, group: dist.ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    """`dist.all_reduce` in place, skipped on a group of one (a gloo collective is a thread hand-off
    even then, which costs milliseconds per call on a loaded CPU)."""
    if group.size() > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def broadcast_from_last_stage(tensor: Tensor, groups: ProcessGroups) -> Tensor:
    """Give every PP stage the last stage's `tensor` (other stages pass a buffer of the same shape)."""
    if groups.pp_size > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
    return tensor


@dataclass(frozen=True)
class StepCounts:
    """Counts of one optimizer step over all its micro-batches and DP ranks (same on every rank)."""

    normalizer: Tensor
    """The loss normaliser N (`agg_loss_normalizer` of the loss's aggregation mode, summed)."""
    tokens: Tensor
    """Response tokens that count (`response_mask` summed)."""
    sequences: Tensor
    """Sequences with at least one such token (the denominator of per-sequence metrics)."""

    @classmethod
    def of(cls, local_batch: PolicyBatch, loss_agg_mode: str, groups: ProcessGroups) -> StepCounts:
        """All-reduce this DP rank's counts of `local_batch` (its whole share of the step)."""
        mask = local_batch.response_mask
        local = torch.stack([agg_loss_normalizer(mask, loss_agg_mode), mask.sum(), mask.any(dim=-1).sum()])
        local = local.to(compute_device(), torch.float64)
        all_reduce(local, groups.dp)
        # float32 like the losses; clamped so a step without valid tokens divides 0 by 1, not by 0.
        normalizer, tokens, sequences = local.clamp(min=1).float()
        return cls(normalizer=normalizer, tokens=tokens, sequences=sequences)


@dataclass
class StepResult:
    """Outcome of one optimizer step, identical on every rank."""

    skipped: bool
    """The loss or a gradient was NaN/Inf: no update was applied."""
    grad_norm: float
    """Global gradient norm before clipping (NaN when skipped)."""
    lr: float
    """Learning rate the step used."""


class TrainEngine:
    """A megatron model under DDP with its optimizer and LR schedule: the trained half of a worker."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        optim: OptimizerConfig,
        lr_decay_steps: int | None,
        groups: ProcessGroups,
    ):
        """`optim`: the role's `optim` section; `lr_decay_steps`: the optimizer step the LR decay ends at
        (the run's optimizer steps, from the batch plan; None only with `lr_decay_style` constant)."""
        self.groups = groups
        self.chunks = wrap_for_training(chunks, optim, groups)
        """This rank's model chunks under DDP, one per virtual stage (one without virtual stages)."""
        self.optimizer, self.scheduler = build_optimizer(self.chunks, optim, lr_decay_steps, groups)
        self.skipped_steps = 0
        """Optimizer steps skipped for a non-finite loss or gradient, since construction."""

    @property
    def model(self) -> DistributedDataParallel:
        """The model under DDP where this rank holds it whole (no virtual stages); else see `chunks`."""
        if len(self.chunks) != 1:
            raise ValueError(f"this rank holds {len(self.chunks)} virtual-stage chunks: read TrainEngine.chunks")
        return self.chunks[0]

    def train_step(
        self, micro_batches: Sequence[MicroBatch], forward_step: ForwardStep, report_keys: Sequence[str]
    ) -> tuple[dict[str, float], StepResult]:
        """One optimizer step over `micro_batches` (this DP rank's share of the step, on the compute
        device: `micro_batches_of`).

        `forward_step`'s loss callback returns the micro-batch's share of the globally normalised
        step loss (see the module docstring) and reports, under `report_keys` (which must include
        "loss"), tensors that add up over micro-batches and DP ranks. Returns those sums (the same
        on every rank) and the step's outcome.
        """
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        undo_averaging = len(micro_batches) * self.groups.dp_size

        def scaled_forward_step(model, micro_batch):
            output, loss_func = forward_step(model, micro_batch)

            def scaled_loss(output_tensor):
                loss, reported = loss_func(output_tensor)
                return loss * undo_averaging, reported

            return output, scaled_loss

        reports = run_schedule(self.chunks, micro_batches, scaled_forward_step, forward_only=False)
        totals = sum_reports(reports, report_keys, self.groups)
        return totals, self._apply_or_skip(totals["loss"])

    def _apply_or_skip(self, step_loss: float) -> StepResult:
        lr = self.optimizer.param_groups[0]["lr"]
        local_ok = math.isfinite(step_loss) and self._local_grads_finite()
        finite = torch.tensor(float(local_ok), device=compute_device())
        # Every rank must agree: a rank that stepped while another skipped would desynchronise.
        all_reduce(finite, self.groups.mp, dist.ReduceOp.MIN)
        all_reduce(finite, self.groups.grad_group, dist.ReduceOp.MIN)
        if finite.item() == 0.0:
            self.skipped_steps += 1
            self.optimizer.zero_grad()
            return StepResult(skipped=True, grad_norm=float("nan"), lr=lr)
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        return StepResult(skipped=not updated, grad_norm=float(grad_norm), lr=lr)

    def offload_training_state(self, settings: OffloadConfig) -> None:
        """After the update: free the gradient buffers and move the optimizer state to host memory, as
        `settings` name, and hand the freed memory back (`memory_stats.empty_cache`). The parameters
        stay for the weight sync (`offload_params`). `onload` before the next update.

        On CPU host memory is the device: DDP's `offload_grad_buffers` frees the buffers' storage
        (`resize_(0)`) there as on a GPU, while moving the optimizer state to the host would free
        nothing (megatron's `offload_to_cpu` moves CUDA tensors only), so that part is GPU only."""
        config = self.chunks[0].config
        if settings.optimizer and not (config.bf16 or config.fp16):
            raise ValueError(
                "offload.optimizer=True needs bf16 or fp16 parameters (megatron keeps fp32 main copies for the "
                "optimizer only then); train in bf16 or set offload.optimizer=False"
            )
        if settings.grads:
            for chunk in self.chunks:
                chunk.offload_grad_buffers(empty_cache=False)
        if settings.optimizer and uses_cuda():
            self.optimizer.offload_to_cpu()
        empty_cache()

    def offload_params(self, settings: OffloadConfig) -> None:
        """After the weight sync: the parameters to pinned host memory when `settings.params` (GPU only:
        on CPU they are in host memory already); nothing may read them (weight sync included) until `onload`.
        Either way the freed memory goes back (`memory_stats.empty_cache`): the sync's buckets and
        collective buffers sit in the allocator's cache until then, and the engines' KV cache wakes next.

        The parameters live in DDP's contiguous buffer only with the distributed optimizer (megatron-core
        `_ParamAndGradBuffer.param_data` is None otherwise, and `offload_to_cpu` then moves nothing)."""
        if settings.params and not self.chunks[0].ddp_config.use_distributed_optimizer:
            raise ValueError(
                "offload.params=True needs the distributed optimizer (megatron keeps the parameters "
                "in DDP's buffer only then); set optim.use_distributed_optimizer=True or "
                "offload.params=False"
            )
        if uses_cuda() and settings.params:
            for buffer in ddp_buffers(self.chunks):
                buffer.offload_to_cpu(move_params=True, move_grads=False)
        empty_cache()

    def onload(self, settings: OffloadConfig) -> None:
        """Bring back what the two offloads moved; gradient buffers come back zeroed."""
        if settings.grads:
            for chunk in self.chunks:
                chunk.restore_grad_buffers()
        if not uses_cuda():
            return
        if settings.params:
            for buffer in ddp_buffers(self.chunks):
                buffer.reload_from_cpu(move_params=True, move_grads=False)
        if settings.optimizer:
            self.optimizer.restore_from_cpu()

    def _local_grads_finite(self) -> bool:
        buffers = ddp_buffers(self.chunks)
        # Any non-finite element makes the norm non-finite (so does a norm overflowing fp32, i.e.
        # gradients ~1e19, which deserve a skip too); one reduction is cheaper than an elementwise
        # isfinite pass over the buffer (measured: 4.6 % of a CPU update step).
        return all(bool(torch.isfinite(torch.linalg.vector_norm(buffer.grad_data))) for buffer in buffers)


def ddp_buffers(chunks: Sequence[DistributedDataParallel]) -> list:
    """The parameter and gradient buffers (megatron's `_ParamAndGradBuffer`s) of every chunk's DDP."""
    return [buffer for chunk in chunks for buffer in chunk.buffers + chunk.expert_parallel_buffers]


def run_model(model: torch.nn.Module, micro_batch: MicroBatch) -> Tensor:
    """Forward of `micro_batch` through (this stage of) a GPTModel: last stage `[r, T, V_local]`
    logits (or `[r, T, 1]` values), other stages the hidden states they send on. Attention follows
    the micro-batch's layout: a dense mask, or THD sequences (`packed_seq_params`); the padding is
    named (`padding_mask`), so a mixture of experts routes it outside its router losses."""
    return model(
        micro_batch.input_ids,
        micro_batch.position_ids,
        micro_batch.attention_mask(),
        packed_seq_params=micro_batch.packed_seq_params(),
        padding_mask=_stage_padding_mask(model, micro_batch.padding_mask()),
    )


def _stage_padding_mask(model: torch.nn.Module, mask: Tensor) -> Tensor:
    """`mask` as this model chunk's layers take it. Under sequence parallelism megatron cuts it to this TP
    rank's share of the sequence where it embeds the tokens, on the first stage only (megatron/core/models/
    gpt/gpt_model.py `GPTModel._preprocess`); a later stage gets it as given, so it is cut here the same way."""
    gpt = unwrap_model(model)
    if gpt.pre_process or not gpt.config.sequence_parallel:
        return mask
    return tensor_parallel.scatter_to_sequence_parallel_region(mask.transpose(0, 1).contiguous()).transpose(0, 1)


def micro_batches_of(
    batch: PolicyBatch, cut: int | TokenBudget, groups: ProcessGroups, config: TransformerConfig
) -> list[MicroBatch]:
    """`batch` cut into micro-batches (`cut`: samples each, or a token budget) on the compute device,
    in the layout the model built with `config` takes: THD on the Transformer Engine spec, padded or
    packed rows with a dense mask on the local spec (`megarl.models.architectures.takes_thd`); with
    pipeline stages every micro-batch has one shape (the stages exchange fixed shapes); every row is
    padded to a multiple of `sequence_multiple`; with context parallelism each THD sequence takes a
    multiple of 2 × CP tokens and this CP rank gets its share of the row
    (`megarl.workers.context_parallel`)."""
    device, multiple, fixed_shape = compute_device(), sequence_multiple(config), groups.pp_size > 1
    if takes_thd(config):
        sample_multiple = 2 * groups.cp_size if groups.cp_size > 1 else 1
        cut_into = cut_thd_micro_batches(
            batch, cut, fixed_shape=fixed_shape, sample_multiple=sample_multiple, row_multiple=multiple
        )
    else:
        cut_into = cut_micro_batches(batch, cut, fixed_shape=fixed_shape)
    micro_batches = [pad_sequence(micro_batch, multiple).to(device) for micro_batch in cut_into]
    if groups.cp is None:
        return micro_batches
    return [split_for_context_parallel(micro_batch, groups.cp) for micro_batch in micro_batches]


def sequence_multiple(config: TransformerConfig) -> int:
    """What a micro-batch's sequence length must be a multiple of for a model built with `config`:
    megatron-core's rule (`get_padding` in megatron/core/models/multimodal/context_parallel.py) for the
    parallelisms megarl runs: TP with sequence parallelism (it splits the sequence over the TP ranks),
    times 2 × CP with context parallelism (each CP rank takes two of 2 × CP chunks, then SP splits its
    share over TP), else 1."""
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    cp = config.context_parallel_size
    return tp * (2 * cp if cp > 1 else 1)


def forward_collect(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    batch: PolicyBatch,
    cut: int | TokenBudget,
    groups: ProcessGroups,
    extract: Callable[[Tensor, MicroBatch], Tensor],
    num_outputs: int,
    run: Callable[[torch.nn.Module, MicroBatch], Tensor] = run_model,
) -> Tensor:
    """Forward-only pass of `batch` in micro-batches (`cut`: samples each, or a token budget),
    without autograd, through `model` (a GPTModel stage, or this rank's list of virtual-stage chunks).

    `extract(last_stage_output, micro_batch) -> [num_outputs, b, R]` picks per-response-token
    outputs; the result `[num_outputs, B, R]`, in `batch`'s row order, is broadcast from the last
    stage to every stage. `run`: the forward of one micro-batch (`run_model`, or one that routes a
    mixture of experts' tokens as the pass says: `megarl.workers.router_replay.ExpertRouting.forward`).
    """

    def forward_step(model, micro_batch):
        def collect(output):
            return output.new_zeros(()), dict(outputs=extract(output, micro_batch))

        return run(model, micro_batch), collect

    config = (model[0] if isinstance(model, Sequence) else model).config
    micro_batches = micro_batches_of(batch, cut, groups, config)
    with torch.no_grad():
        reports = run_schedule(model, micro_batches, forward_step, forward_only=True)
    out = torch.zeros(num_outputs, len(batch), batch.response_length, device=compute_device())
    if groups.is_last_stage:
        for micro_batch, report in zip(micro_batches, reports):
            out[:, micro_batch.rows] = report["outputs"]
    return broadcast_from_last_stage(out, groups).cpu()


def load_model(
    model_dir: str | Path,
    groups: ProcessGroups,
    *,
    model: ModelConfig,
    recompute: RecomputeConfig,
    value_head: bool,
    sequence_parallel: bool,
    moe: MoeConfig = MoeConfig(),
) -> tuple[list[torch.nn.Module], int]:
    """This rank's GPTModel stage, as its chunks (one per virtual stage of `groups`; one without), with an
    HF checkpoint's weights (a value head keeps its small random init), in the `model` section's dtype and
    layer spec (its checkpoint is `model_dir`), with megatron's sequence parallelism over the TP ranks or without, a mixture-of-experts
    model's router losses as `moe` says, and the real (HF) vocabulary size."""
    chunks = build_model_chunks(
        model_dir,
        groups,
        value_head=value_head,
        params_dtype=TORCH_DTYPES[model.dtype],
        transformer_impl=resolve_transformer_impl(model.transformer_impl, compute_device().type, model.dtype),
        sequence_parallel=sequence_parallel,
        **recompute_transformer_fields(recompute),
        **moe_transformer_fields(moe),
    )
    for chunk in chunks:
        load_hf_weights(chunk, model_dir, groups)
    return chunks, read_model_dims(model_dir).vocab_size


SELECTIVE_RECOMPUTE_MODULES = ["core_attn"]
"""What `granularity: selective` recomputes: the attention core (softmax and its dropout), the part the
memory estimate (`megarl.config.memory`) drops for it."""


def recompute_transformer_fields(recompute: RecomputeConfig) -> dict:
    """The megatron-core `TransformerConfig` overrides a role's `recompute` section stands for (its
    checks, e.g. `full` needs `num_layers`, are the config's: `megarl.config.validate`)."""
    if recompute.granularity == "none":
        return {}
    if recompute.granularity == "selective":
        return dict(recompute_granularity="selective", recompute_modules=list(SELECTIVE_RECOMPUTE_MODULES))
    return dict(
        recompute_granularity=recompute.granularity,
        recompute_method=recompute.method,
        recompute_num_layers=recompute.num_layers,
    )


def moe_transformer_fields(moe: MoeConfig) -> dict:
    """The megatron-core `TransformerConfig` overrides a role's `moe` section stands for; an unset
    coefficient leaves the architecture's value (the checkpoint's `router_aux_loss_coef`; no z-loss), and
    `router_replay` turns on `moe_enable_routing_replay` (`megarl.workers.router_replay`)."""
    fields = {"moe_aux_loss_coeff": moe.aux_loss_coeff, "moe_z_loss_coeff": moe.z_loss_coeff}
    replay = {"moe_enable_routing_replay": True} if moe.router_replay else {}
    return {name: value for name, value in fields.items() if value is not None} | replay


def check_divides(total: int, part: int, part_name: str, total_name: str) -> None:
    """ValueError naming `part_name` unless `part` divides `total`."""
    if part <= 0 or total % part != 0:
        raise ValueError(
            f"{part_name}={part} must divide the {total} {total_name} ({total} % {part} != 0); "
            f"choose a {part_name} that divides it"
        )


def sum_reports(reports: Sequence[dict[str, Tensor]], keys: Sequence[str], groups: ProcessGroups) -> dict[str, float]:
    """Sum each key over micro-batches (last stage) and DP ranks, then share with every PP stage."""
    local = torch.zeros(len(keys), dtype=torch.float64, device=compute_device())
    for report in reports:
        local += torch.stack([report[key].detach().to(torch.float64) for key in keys])
    all_reduce(local, groups.dp)
    broadcast_from_last_stage(local, groups)
    return dict(zip(keys, local.cpu().tolist()))


def summarize_steps(steps: Sequence[tuple[dict[str, float], StepResult]]) -> dict[str, float]:
    """Mean of each metric over the applied steps, plus the step counts."""
    applied = [(sums, result) for sums, result in steps if not result.skipped]
    metrics: dict[str, float] = dict(steps=float(len(steps)), skipped_steps=float(len(steps) - len(applied)))
    if applied:
        for key in applied[0][0]:
            metrics[key] = sum(sums[key] for sums, _ in applied) / len(applied)
        metrics["grad_norm"] = sum(result.grad_norm for _, result in applied) / len(applied)
        metrics["lr"] = applied[-1][1].lr
    return metrics
