"""Checks of a Megatron role's optimizer and parallel sections, shared by the RL config (`validate`) and the
SFT config (`megarl.config.sft`): each appends `Problem`s naming the key under `prefix`."""

from __future__ import annotations

from megarl.config.problems import Problem
from megarl.config.roles import OptimizerConfig, ParallelConfig


def need(problems: list[Problem], ok: bool, key: str, value, why: str, fix: str) -> None:
    """Append the problem (key, value, why, fix) unless `ok`."""
    if not ok:
        problems.append(Problem(key, value, why, fix))


def check_optimizer(prefix: str, optim: OptimizerConfig, problems: list[Problem]) -> None:
    need(problems, optim.lr > 0, f"{prefix}.lr", optim.lr, "the learning rate must be > 0", "e.g. 1e-6")
    # Against a non-positive lr the bound is meaningless; lr's own problem says what to fix.
    need(
        problems,
        optim.min_lr >= 0 and (optim.lr <= 0 or optim.min_lr <= optim.lr),
        f"{prefix}.min_lr",
        optim.min_lr,
        f"must lie in [0, lr = {optim.lr}]",
        "set it to 0 or a fraction of lr",
    )
    need(problems, optim.weight_decay >= 0, f"{prefix}.weight_decay", optim.weight_decay, "must be >= 0", "e.g. 0.01")
    need(
        problems,
        all(0 <= beta < 1 for beta in optim.betas),
        f"{prefix}.betas",
        list(optim.betas),
        "each beta must lie in [0, 1)",
        "e.g. [0.9, 0.999]",
    )
    need(problems, optim.eps > 0, f"{prefix}.eps", optim.eps, "must be > 0", "e.g. 1e-8")
    need(
        problems,
        optim.lr_warmup_steps >= 0,
        f"{prefix}.lr_warmup_steps",
        optim.lr_warmup_steps,
        "must be >= 0",
        "set 0 for no warm-up",
    )
    need(
        problems, optim.clip_grad >= 0, f"{prefix}.clip_grad", optim.clip_grad, "must be >= 0 (0 disables)", "e.g. 1.0"
    )


def check_cpu_offload(
    prefix: str, optim: OptimizerConfig, dtype: str, problems: list[Problem], offload_optimizer: bool = False
) -> None:
    """`{prefix}.cpu_offload` (megatron-core's HybridDeviceOptimizer) and its fraction; `prefix` is the
    optimizer section ("actor.optim", "optim"); `offload_optimizer`: the role's `offload.optimizer`."""
    fraction = optim.cpu_offload_fraction
    need(
        problems,
        0 < fraction <= 1,
        f"{prefix}.cpu_offload_fraction",
        fraction,
        "the share of the optimizer state kept in host memory must lie in (0, 1]",
        "e.g. 1.0 (all of it) or 0.5",
    )
    if not optim.cpu_offload:
        need(
            problems,
            fraction == 1.0 or not 0 < fraction <= 1,
            f"{prefix}.cpu_offload_fraction",
            fraction,
            f"has no effect while {prefix}.cpu_offload is false",
            f"set {prefix}.cpu_offload: true, or remove it",
        )
        return
    need(
        problems,
        optim.use_distributed_optimizer,
        f"{prefix}.cpu_offload",
        True,
        "megatron steps the offloaded state through the precision-aware distributed optimizer (Megatron-LM "
        "refuses --optimizer-cpu-offload without --use-precision-aware-optimizer, which needs the distributed "
        f"optimizer), and {prefix}.use_distributed_optimizer is false",
        f"set {prefix}.use_distributed_optimizer: true, or {prefix}.cpu_offload: false",
    )
    need(
        problems,
        dtype == "bfloat16",
        f"{prefix}.cpu_offload",
        True,
        f"model.dtype is {dtype}: megatron-core 0.16.1's distributed optimizer hands float32 parameters to the "
        "offloading optimizer as views of the model's own (\"can't optimize a non-leaf Tensor\"); it offloads "
        "the fp32 main copy that bfloat16 training keeps",
        f"use model.dtype: bfloat16, or {prefix}.cpu_offload: false",
    )
    role = prefix.split(".")[0]
    need(
        problems,
        not offload_optimizer,
        f"{role}.offload.optimizer",
        True,
        f"{prefix}.cpu_offload keeps the optimizer state in host memory already",
        f"set {role}.offload.optimizer: false",
    )


def check_virtual_pipeline(prefix: str, parallel: ParallelConfig, problems: list[Problem]) -> None:
    """The interleaved schedule needs virtual stages to interleave (>= 2) and a pipeline to run them on
    (megatron-core's `initialize_model_parallel` refuses virtual stages at PP 1). `prefix` as
    `check_sequence_parallel`'s."""
    vpp, pp = parallel.virtual_pipeline_model_parallel_size, parallel.pipeline_model_parallel_size
    if vpp is None:
        return
    key = f"{prefix}parallel.virtual_pipeline_model_parallel_size"
    need(
        problems,
        vpp >= 2,
        key,
        vpp,
        "the interleaved schedule needs at least 2 virtual stages per rank",
        "use 2 or more, or remove it (null) for one chunk per rank",
    )
    need(
        problems,
        pp > 1,
        key,
        vpp,
        f"virtual stages interleave a pipeline, and {prefix}parallel.pipeline_model_parallel_size is {pp}",
        f"set {prefix}parallel.pipeline_model_parallel_size to 2 or more, or remove the virtual pipeline size",
    )


def check_interleaved_micro_batches(
    key: str, value, parallel: ParallelConfig, micro_batches: int, what: str, problems: list[Problem]
) -> None:
    """An update's `micro_batches` per rank under the interleaved schedule. megatron-core's
    `forward_backward_pipelining_with_interleaving` (pipeline_parallel/schedules.py) runs them in groups of
    `microbatch_group_size_per_vp_stage` (PP by default) and raises unless PP <= group <= M and M mod group is
    0 or >= PP: with the default, M must be a multiple of PP. (megarl gives a pass of another count M >= PP, a
    forward pass or a packed cut, one group of all M, `megatron_train.set_interleaving_group`; an update of
    padded micro-batches is held to the default, whose warm-up keeps the fewest activations.) `key`/`value`:
    the setting to change; `what`: how `micro_batches` came about."""
    vpp, pp = parallel.virtual_pipeline_model_parallel_size, parallel.pipeline_model_parallel_size
    if vpp is None or vpp < 2 or pp < 2:
        return
    need(
        problems,
        micro_batches >= pp and micro_batches % pp == 0,
        key,
        value,
        f"{what} = {micro_batches} micro-batches per rank, and megatron's interleaved schedule (virtual pipeline "
        f"size {vpp}) runs them in groups of PP {pp}: it needs a multiple of {pp}",
        f"choose a micro-batch size that makes the count a multiple of {pp}, or no virtual pipeline",
    )


def check_sequence_parallel(prefix: str, parallel: ParallelConfig, problems: list[Problem]) -> None:
    """Sequence parallelism splits the sequence over the TP ranks: it needs TP > 1. `prefix` is the role
    ("actor.", ...) or "" for a top-level `parallel` section (`megarl sft`)."""
    tp = parallel.tensor_model_parallel_size
    need(
        problems,
        not parallel.sequence_parallel or tp > 1,
        f"{prefix}parallel.sequence_parallel",
        True,
        f"sequence parallelism splits the sequence over the TP ranks, and {prefix}parallel.tensor_model_parallel_size "
        f"is {tp}",
        f"set {prefix}parallel.sequence_parallel: false, or a tensor_model_parallel_size of 2 or more",
    )


def check_expert_grid(prefix: str, parallel: ParallelConfig, gpus: int, problems: list[Problem]) -> bool:
    """megatron lays each pipeline stage's experts out as expert TP × EP × expert DP over the stage's
    GPUs: expert TP × EP must divide `gpus` ÷ PP. `prefix` as in `check_sequence_parallel`; `gpus` the
    role's training GPUs, already a multiple of TP × PP. Returns whether it holds."""
    pp, ep = parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size
    stage = gpus // pp
    ok = stage % (etp * ep) == 0
    divisors = ", ".join(str(d) for d in range(1, min(stage, 64) + 1) if stage % d == 0)  # a recipe may state millions
    need(
        problems,
        ok,
        f"{prefix}parallel.expert_model_parallel_size",
        ep,
        f"expert TP {etp} × EP {ep} = {etp * ep} does not divide the {stage} GPUs of a pipeline stage ({gpus} GPUs ÷ "
        f"PP {pp}): megatron lays each stage's experts out as expert TP × EP × expert DP",
        f"choose expert TP × EP dividing {stage}: {divisors}",
    )
    return ok


def check_context_parallel(
    prefix: str,
    parallel: ParallelConfig,
    transformer_impl: str,
    budgets: dict[str, int | None],
    problems: list[Problem],
) -> None:
    """Context parallelism runs in Transformer Engine's attention, on THD micro-batches: the layer spec must be
    TE's (megatron's local `DotProductAttention` asserts context_parallel_size == 1), and each token budget in
    `budgets` (key -> value, None: unset) a multiple of 2 × CP (× TP with sequence parallelism), megatron's
    padding rule (`megarl.workers.megatron_train.sequence_multiple`), so a budget is the row a pipeline stage
    sends. `prefix` as `check_sequence_parallel`'s."""
    cp, key = parallel.context_parallel_size, f"{prefix}parallel.context_parallel_size"
    if cp <= 1:  # < 1: the batch plan's size check names it
        return
    need(
        problems,
        transformer_impl == "transformer_engine",
        key,
        cp,
        "context parallelism runs in Transformer Engine's attention on THD micro-batches, and "
        f"model.transformer_impl is {transformer_impl!r} (megatron's local spec has no context-parallel attention)",
        f"set model.transformer_impl: transformer_engine (GPU, bfloat16), or {key}: 1",
    )
    multiple = context_parallel_multiple(parallel)
    what = "2 × CP × TP (sequence parallelism splits each CP rank's share over TP)" if multiple > 2 * cp else "2 × CP"
    for budget_key, budget in budgets.items():
        need(
            problems,
            budget is None or budget < 1 or budget % multiple == 0,
            budget_key,
            budget,
            f"with {key}: {cp} a micro-batch's tokens are cut into 2 × CP chunks and must be a multiple of {what} = "
            f"{multiple}",
            f"use a multiple of {multiple}, e.g. {-(-(budget or 1) // multiple) * multiple}",
        )


def context_parallel_multiple(parallel: ParallelConfig) -> int:
    """What a micro-batch's tokens must be a multiple of under context parallelism: 2 × CP chunks, × TP with
    sequence parallelism (megarl.workers.megatron_train.sequence_multiple); 1 without CP."""
    cp = parallel.context_parallel_size
    if cp <= 1:
        return 1
    return 2 * cp * (parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1)
