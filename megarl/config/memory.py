"""Per-GPU memory estimate of a recipe, per role, so `megarl validate` can say whether it fits, and
refuse a `rollout.gpu_memory_utilization` the colocated engines cannot have (`rollout_budget_problems`)
and a CPU `rollout.kv_cache_gib` the estimate does not fit (`kv_cache_problems`).

Pure arithmetic (no torch). It describes what the Megatron roles run (megarl.workers.megatron_train,
megarl.models.architectures) for the rank that holds the most (the first pipeline stage, which also
holds the activations of the most micro-batches in flight):

- **parameters**: this rank's TP × PP shard, in `model.dtype` (every parameter, norms included). The
  vocabulary is padded to a multiple of 128 × TP as megatron does; the first stage holds the
  embedding, the last the output layer (absent when tied) and the final norm; norms are replicated
  over TP.
  A mixture of experts (Qwen3-MoE) holds the router and E / EP experts per layer, each expert cut
  over expert TP (the role's TP unless `expert_tensor_parallel_size` says).
- **gradients**: megatron DDP's grad buffer, always fp32 (`grad_reduce_in_fp32`: the main grads of
  mixed precision), 4 bytes per parameter.
- **optimizer**: Adam's two fp32 moments, plus the fp32 main copy of the parameters when they are
  bfloat16 (megatron's mixed-precision optimizers); divided by DP with the distributed optimizer. Per
  parameter: fp32 4 + 4 + 8/DP bytes, bf16 2 + 4 + 12/DP (megatron's distributed-optimizer table,
  with fp32 gradients). `optim.cpu_offload` keeps `cpu_offload_fraction` of it in host memory
  (megatron's HybridDeviceOptimizer): the GPU holds the rest. Experts' state shards over expert DP
  (a stage's GPUs ÷ (expert TP × EP)) instead of DP.
- **activations** of one training micro-batch of `micro_batch_size_per_gpu` samples of
  S = `data.max_prompt_length + rollout.max_new_tokens` tokens (packed: `max_tokens_per_micro_batch` ÷ S
  rows of S tokens, "auto" resolved by `megarl.config.token_budget`: as many rows as padded) (no dropout), of which a rank holds S / CP tokens per sample with context parallelism
  (`parallel.context_parallel_size`: each sequence split over CP ranks),
  per token and layer, in elements of `model.dtype` (Q = heads × head_dim, K = KV heads × head_dim,
  a = heads, f = ffn, h = hidden, t = TP):

      4h                 inputs of the two norms and of the two linears after them; 4h / t with sequence
                         parallelism (each TP rank keeps its share of the sequence; megatron gathers the
                         linears' inputs again in backward)
      + (2Q + 2K) / t    q, k, v for attention and the attention context
      + a·S / t          the softmax probabilities, which the local spec's softmax keeps; Transformer
                         Engine's THD attention (flash/cuDNN, `megarl.workers.thd`) keeps none, so with
                         `model.transformer_impl: transformer_engine` (context parallelism's spec) the
                         term is 0 (with "auto" it stays: an upper bound)
      + 3f / t           fc1 output (gate, up) and the SwiGLU output; with experts
                         k·(h + 3f_e / t_e) for each token's k dispatched copies and its experts' (top-k
                         k, expert width f_e, expert TP t_e)

  With 1F1B the first stage keeps PP micro-batches in flight of L/PP layers each: L layers' worth. The
  interleaved schedule (VPP = v ≥ 2 chunks of L/(PP·v) layers per stage) warms up 2(PP − 1) + (v − 1)·PP
  chunk passes on the first stage before its first backward (megatron-core's `get_pp_rank_microbatches`,
  pipeline_parallel/schedules.py), one more in flight at steady state: L·(1 + (PP − 1)/(PP·v)) layers' worth.
  Full recompute keeps only each layer's input (h per token and layer, h / t with sequence parallelism)
  plus one layer's working set as above; selective recompute (core_attn) drops the a·S/t term. The last stage adds the logits
  per token: V_padded/t in `model.dtype`, their fp32 upcast when that is bfloat16, and the fp32
  exponentials of the log-softmax (megarl.workers.logprobs).
- **rollout**: on GPU vLLM takes `rollout.gpu_memory_utilization` of the GPU (weights, KV cache and
  its activations; vLLM refuses to start unless that much is free); on CPU the weights / rollout TP
  plus `rollout.kv_cache_gib`.

Outside PyTorch's allocator, each process on a GPU holds its CUDA context and NCCL's communicator
buffers (`RUNTIME_GIB_PER_PROCESS`); colocated, every Megatron process of a training GPU and the engine's
worker share it. And a GPU must keep `MARGIN_GIB` free at its peak for what the table does not model
(the caching allocator's fragmentation, vLLM's sampler, the weight sync's buckets): a recipe fits when
peak + runtime + margin <= the GPU, and the verdict states what is left (issue 32, item 1: a KV-cache
wake after the update must not meet a full GPU).

Peak per GPU. Split placement: the training GPUs hold the trained roles during the update (actor,
critic, reference parameters), the rollout GPUs the engine. Colocated: the larger of the rollout
phase (the engine's share + what the Megatron roles keep resident: parameters unless `offload.params`,
gradients unless `offload.grads`, the optimizer unless `offload.optimizer` with bfloat16 parameters (with fp32 ones
megatron's optimizer updates the model's own parameters, so there is nothing separate to move and
the trainer refuses the setting), the reference unless `ref.offload_params`) and the training phase
(every trained role's full state + one role's activations + the reference, with the engine asleep
when `rollout.free_cache_engine`, else its share as well).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.config.batch_plan import plan_batches, uses_reference
from megarl.config.config import Config
from megarl.config.model_facts import ModelFactsError, load_model_dims
from megarl.config.problems import Problem
from megarl.config.roles import ParallelConfig, RecomputeConfig
from megarl.config.rollout import rollout_dtype
from megarl.config.token_budget import sample_token_bound, token_budget
from megarl.models.arch.dense import expert_parameters, layer_parameters
from megarl.models.hf_config import ModelDims
from megarl.models.layout import VOCAB_DIVISIBLE_BY, padded_vocab_size

GIB = 2**30
RUNTIME_GIB_PER_PROCESS = 1.0
"""A CUDA process's memory outside PyTorch's allocator: its CUDA context with torch's kernels loaded
(about 0.5 GiB on Hopper) and NCCL's buffers for the communicators it joins (tens to a few hundred MiB
each), rounded up."""
MARGIN_GIB = 2.0
"""What a GPU keeps free at its peak for what the estimate does not model (module docstring)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
FP32 = 4
ADAM_MOMENTS = 2 * FP32


def stage_parameters(
    dims: ModelDims, tp: int, pp: int, stage: int, value_head: bool = False, ep: int = 1, etp: int | None = None
) -> int:
    """Parameters on one rank of pipeline stage `stage` (layers split evenly over the stages) of a (TP, PP, EP,
    expert TP) layout: a mixture of experts' E / EP experts cut over expert TP `etp` (None: `tp`)."""
    count = dims.num_layers // pp * layer_parameters(dims, tp, ep, etp)
    vocab_shard = padded_vocab_size(dims.vocab_size, VOCAB_DIVISIBLE_BY, tp) * dims.hidden_size // tp
    if stage == 0:
        count += vocab_shard
    if stage == pp - 1:
        count += dims.hidden_size  # final norm
        if value_head:
            count += dims.hidden_size
        elif not dims.tie_word_embeddings or pp > 1:  # tied across stages: the last stage keeps a copy
            count += vocab_shard
    return count


def rank_parameters(
    dims: ModelDims, tp: int, pp: int, value_head: bool = False, ep: int = 1, etp: int | None = None
) -> int:
    """The most parameters any rank of a (TP, PP, EP, expert TP) layout holds."""
    return max(stage_parameters(dims, tp, pp, stage, value_head, ep, etp) for stage in range(pp))


def total_parameters(dims: ModelDims) -> int:
    """Parameters of the unsharded model (HF vocabulary, no padding)."""
    embedding = dims.vocab_size * dims.hidden_size
    output = 0 if dims.tie_word_embeddings else embedding
    return dims.num_layers * layer_parameters(dims, 1) + embedding + output + dims.hidden_size


def activation_elements_per_token(
    dims: ModelDims,
    tp: int,
    seq_len: int,
    recompute: str,
    etp: int | None = None,
    sequence_parallel: bool = False,
    softmax_probs: bool = True,
) -> int:
    """Elements one transformer layer keeps per token for backward (see the module docstring);
    with "full" recompute, only the layer input. `sequence_parallel`: the sequence-split tensors are
    1/TP; `softmax_probs`: the attention keeps its probabilities (the local spec; TE's does not)."""
    split = tp if sequence_parallel else 1
    if recompute == "full":
        return dims.hidden_size // split
    attention = dims.num_attention_heads * seq_len // tp if recompute != "selective" and softmax_probs else 0
    return (
        4 * dims.hidden_size // split
        + (2 * dims.q_size + 2 * dims.kv_size) // tp
        + attention
        + _mlp_activation_elements(dims, tp, etp)
    )


def _mlp_activation_elements(dims: ModelDims, tp: int, etp: int | None) -> int:
    """The MLP's share per token: 3f / t dense; with experts, top-k × (h + 3f_e / expert TP) (each
    token's k dispatched copies and its experts' fc1 and SwiGLU outputs)."""
    if not dims.num_experts:
        return 3 * dims.ffn_hidden_size // tp
    return dims.num_experts_per_tok * (dims.hidden_size + 3 * dims.moe_ffn_hidden_size // (etp or tp))


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one role needs on one GPU."""

    role: str
    """actor, critic, ref or rollout."""
    parameters: int
    """This rank's shard of the weights (rollout on CPU: the engine's copy)."""
    gradients: int
    """DDP's grad buffer (trained roles)."""
    optimizer: int
    """Adam moments and fp32 main parameters, sharded over DP with the distributed optimizer."""
    activations: int
    """Training micro-batch activations (logits included) of a trained role; 0 otherwise."""
    other: int = 0
    """rollout: the engine's share (KV cache, and on GPU its weights and activations too)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of every role of a recipe and the peak of the busiest GPU."""

    roles: list[RoleMemory]
    """One entry per role of the recipe, rollout last."""
    peak_bytes: int
    """The most bytes one GPU holds at once (see the module docstring for the phases)."""
    peak_phase: str
    """Where the peak is: "rollout phase", "training phase" (colocated), "training GPUs" or "rollout GPUs" (split)."""
    gpu_memory_bytes: int
    """The GPU size compared against."""
    runs: tuple[str, ...] = ()
    """What the estimate counts, one line each (precision, offload, the rollout engine's share)."""
    runtime_bytes: int = 0
    """CUDA contexts and NCCL buffers of the processes on the peak's GPU (`RUNTIME_GIB_PER_PROCESS`); 0 on CPU."""
    margin_bytes: int = 0
    """What the peak's GPU must keep free (`MARGIN_GIB`); 0 on CPU."""

    @property
    def spare_bytes(self) -> int:
        """What the busiest GPU has left at its peak, runtime included, before the margin."""
        return self.gpu_memory_bytes - self.peak_bytes - self.runtime_bytes

    @property
    def fits(self) -> bool:
        return self.spare_bytes >= self.margin_bytes


def state_bytes(
    dims: ModelDims,
    parallel: ParallelConfig,
    dp: int,
    dtype: str,
    *,
    distributed_optimizer: bool,
    trained: bool,
    value_head: bool = False,
    offloaded: float = 0.0,
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) bytes on the busiest rank of a role (module docstring) on its GPU;
    `offloaded`: the share of the optimizer state kept in host memory (`optim.cpu_offload_fraction`)."""
    tp, pp, ep = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.expert_model_parallel_size,
    )
    etp = parallel.expert_tensor_parallel_size or tp
    params = rank_parameters(dims, tp, pp, value_head, ep, etp)
    width = DTYPE_BYTES[dtype]
    if not trained:
        return params * width, 0, 0
    per_parameter = ADAM_MOMENTS + (FP32 if width < FP32 else 0)
    optimizer = params * per_parameter
    if distributed_optimizer:
        # Dense parameters shard over DP, experts over expert DP (a stage's GPUs ÷ (expert TP × EP)).
        experts = dims.num_layers // pp * expert_parameters(dims, ep, etp)
        expert_dp = dp * tp // (etp * ep)
        optimizer = -(-(params - experts) * per_parameter // dp) + -(-experts * per_parameter // expert_dp)
    return params * width, params * FP32, round(optimizer * (1 - offloaded))


def activation_bytes(
    dims: ModelDims,
    parallel: ParallelConfig,
    recompute: RecomputeConfig,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    value_head: bool = False,
    transformer_impl: str = "auto",
) -> int:
    """Training activations of one micro-batch on the first stage (all its in-flight micro-batches),
    plus the last stage's logits and their fp32 working copies when PP is 1 (else they are on another rank).
    `transformer_impl`: the layer spec (`model.transformer_impl`; only Transformer Engine's is known to keep no
    attention probabilities)."""
    tp, pp, etp = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.expert_tensor_parallel_size,
    )
    tokens = micro_batch * seq_len // parallel.context_parallel_size  # this rank's share of each sequence
    width = DTYPE_BYTES[dtype]
    granularity = recompute.granularity

    def per_token(granularity: str) -> int:
        return activation_elements_per_token(
            dims,
            tp,
            seq_len,
            granularity,
            etp,
            sequence_parallel=parallel.sequence_parallel,
            softmax_probs=transformer_impl != "transformer_engine",
        )

    if granularity == "full" and recompute.method == "block":
        # The first `num_layers` layers of each stage are recomputed, the others keep everything.
        per_stage = dims.num_layers // pp
        recomputed = min(recompute.num_layers or 0, per_stage)
        kept = (recomputed * per_token("full") + (per_stage - recomputed) * per_token("none")) * pp
    else:
        kept = dims.num_layers * per_token(granularity)
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    if vpp > 1:  # the interleaved schedule's extra chunk passes in flight (module docstring)
        kept = kept * (pp * vpp + pp - 1) // (pp * vpp)
    if granularity == "full":  # plus the working set of the one layer being recomputed
        kept += per_token("none")
    # Logits in the model dtype, their fp32 upcast (none when already fp32), the fp32 exponentials.
    logit_bytes = width + (FP32 if width < FP32 else 0) + FP32
    logits = (
        0
        if pp > 1
        else tokens
        * (FP32 if value_head else logit_bytes * padded_vocab_size(dims.vocab_size, VOCAB_DIVISIBLE_BY, tp) // tp)
    )
    return tokens * kept * width + logits


def estimate_memory(
    config: Config,
    dims: ModelDims,
    *,
    train_gpus: int,
    gpu_memory_gib: float = 80.0,
    on_gpu: bool = True,
    processes_per_train_gpu: int = 1,
) -> MemoryEstimate:
    """Per-GPU memory of `config`'s roles for a model of `dims` on `train_gpus` training GPUs
    (`plan_batches(config).train_gpus`), each shared by `processes_per_train_gpu` processes (the batch
    plan's, engine included when colocated). `on_gpu=False` sizes the rollout as on CPU."""
    dtype = config.model.dtype
    seq_len = sample_token_bound(config)
    roles: list[RoleMemory] = []
    trained = [("actor", config.actor, False)] + ([("critic", config.critic, True)] if config.critic.enable else [])
    for name, role, value_head in trained:
        p = role.parallel
        dp = train_gpus // (p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size)
        optim_config = role.optim
        params, grads, optim = state_bytes(
            dims,
            p,
            # megatron's distributed optimizer shards over DP × CP (the gradient group): CP ranks hold the same weights
            dp * p.context_parallel_size,
            dtype,
            distributed_optimizer=optim_config.use_distributed_optimizer,
            trained=True,
            value_head=value_head,
            offloaded=optim_config.cpu_offload_fraction if optim_config.cpu_offload else 0.0,
        )
        # A packed micro-batch: rows of at most S tokens, as many as the budget holds ("auto": as padded).
        budget = token_budget(role, seq_len)
        micro_batch = role.micro_batch_size_per_gpu if budget is None else max(1, budget // seq_len)
        acts = activation_bytes(
            dims, p, role.recompute, micro_batch, seq_len, dtype, value_head, config.model.transformer_impl
        )
        roles.append(RoleMemory(name, params, grads, optim, acts))
    if uses_reference(config):
        params, _, _ = state_bytes(dims, config.ref.parallel, 1, dtype, distributed_optimizer=False, trained=False)
        roles.append(RoleMemory("ref", params, 0, 0, 0))
    rollout = config.rollout
    if on_gpu:
        engine = int(rollout.gpu_memory_utilization * gpu_memory_gib * GIB)
        roles.append(RoleMemory("rollout", 0, 0, 0, 0, other=engine))
    else:
        engine_dtype = rollout_dtype(rollout, dtype)
        weights = total_parameters(dims) * DTYPE_BYTES[engine_dtype] // rollout.tensor_model_parallel_size
        roles.append(RoleMemory("rollout", weights, 0, 0, 0, other=int(rollout.kv_cache_gib * GIB)))
    peak, phase = _peak(config, roles)
    processes = 1 if phase == "rollout GPUs" else processes_per_train_gpu  # a rollout GPU: one engine worker
    runtime = int(processes * RUNTIME_GIB_PER_PROCESS * GIB) if on_gpu else 0
    return MemoryEstimate(
        roles,
        peak,
        phase,
        int(gpu_memory_gib * GIB),
        _what_runs(config, on_gpu, gpu_memory_gib),
        runtime,
        int(MARGIN_GIB * GIB) if on_gpu else 0,
    )


def _what_runs(config: Config, on_gpu: bool, gpu_memory_gib: float) -> tuple[str, ...]:
    """The lines `memory_table.format_estimate` prints above the table (see the module docstring)."""
    dtype = config.model.dtype
    if DTYPE_BYTES[dtype] < FP32:
        precision = (
            f"{dtype} parameters, fp32 main grads, fp32 main parameters + Adam moments "
            f"({DTYPE_BYTES[dtype]} + 4 + 12 B per parameter)"
        )
    else:
        precision = "fp32 parameters, grads and Adam moments, no main copy (4 + 4 + 8 B per parameter)"
    optimizer_moves = DTYPE_BYTES[dtype] < FP32
    offloaded = [
        f"{role}.offload.{part}"
        for role in ("actor", "critic")
        for part in ("params", "grads")
        if getattr(getattr(config, role).offload, part)
    ]
    offloaded += [
        f"{role}.offload.optimizer"
        for role in ("actor", "critic")
        if getattr(config, role).offload.optimizer and optimizer_moves
    ]
    offloaded += ["ref.offload_params"] if config.ref.offload_params else []
    lines = [f"precision: {precision}; the distributed optimizer shards the 8-12 B over DP"]
    for role in ("actor", "critic"):
        optim = getattr(config, role).optim
        if optim.cpu_offload and (role == "actor" or config.critic.enable):
            lines.append(
                f"{role}.optim.cpu_offload: {optim.cpu_offload_fraction:.0%} of the optimizer state in host memory"
            )
    if config.placement.mode == "colocated":
        lines.append("offload during rollout: " + (", ".join(offloaded) if offloaded else "none"))
    rollout = config.rollout
    if on_gpu:
        lines.append(
            f"rollout: vLLM takes gpu_memory_utilization {rollout.gpu_memory_utilization} of each "
            f"{'shared' if config.placement.mode == 'colocated' else 'rollout'} GPU "
            f"({rollout.gpu_memory_utilization * gpu_memory_gib:.1f} GiB)"
        )
    else:
        lines.append(
            f"rollout: the engine's weights in {rollout_dtype(rollout, dtype)} and kv_cache_gib {rollout.kv_cache_gib} of host memory"
        )
    return tuple(lines)


def _peak(config: Config, roles: list[RoleMemory]) -> tuple[int, str]:
    by_name = {r.role: r for r in roles}
    engine = by_name["rollout"].total
    trained = [r for r in roles if r.role in ("actor", "critic")]
    ref = by_name["ref"].parameters if "ref" in by_name else 0
    states = sum(r.parameters + r.gradients + r.optimizer for r in trained)
    training = states + max(r.activations for r in trained) + ref
    if config.placement.mode == "split":
        return (training, "training GPUs") if training >= engine else (engine, "rollout GPUs")
    rollout_phase = engine + resident_during_rollout(config, roles)
    training_phase = training + (0 if config.rollout.free_cache_engine else engine)
    return (rollout_phase, "rollout phase") if rollout_phase >= training_phase else (training_phase, "training phase")


def resident_during_rollout(config: Config, roles: list[RoleMemory]) -> int:
    """Bytes the Megatron roles keep on a colocated GPU while the engines generate: what their
    `offload` settings (and `ref.offload_params`) leave there (module docstring)."""
    offload = {"actor": config.actor.offload, "critic": config.critic.offload}
    # Only bf16 parameters have a separate fp32 optimizer state to move (module docstring).
    optimizer_moves = DTYPE_BYTES[config.model.dtype] < FP32
    resident = 0
    for r in roles:
        if r.role in offload:
            settings = offload[r.role]
            resident += (
                (0 if settings.params else r.parameters)
                + (0 if settings.grads else r.gradients)
                + (0 if settings.optimizer and optimizer_moves else r.optimizer)
            )
        elif r.role == "ref" and not config.ref.offload_params:
            resident += r.parameters
    return resident


def rollout_budget_problems(config: Config, gpu_memory_gib: float) -> list[Problem]:
    """Colocated on GPUs: vLLM starts only when `rollout.gpu_memory_utilization` of the GPU is free,
    beside what the Megatron roles keep resident while the engines generate (the engines start after
    they offload: `megarl.cluster.handover`); a problem naming the largest value that fits when it is
    not. No problem when the model's shape is unknown (`memory_table.memory_report` says why) or nothing is
    colocated on a GPU."""
    if config.placement.mode != "colocated" or config.trainer.device == "cpu":
        return []
    try:
        dims, _ = load_model_dims(config.model.path)
    except ModelFactsError:
        return []
    estimate = estimate_memory(config, dims, train_gpus=plan_batches(config).train_gpus, gpu_memory_gib=gpu_memory_gib)
    resident = resident_during_rollout(config, estimate.roles)
    most = int((estimate.gpu_memory_bytes - resident) / estimate.gpu_memory_bytes * 100) / 100
    utilization = config.rollout.gpu_memory_utilization
    if utilization <= most:
        return []
    return [
        Problem(
            "rollout.gpu_memory_utilization",
            utilization,
            f"the engines would take {utilization * gpu_memory_gib:.1f} GiB of each {gpu_memory_gib:g} GiB GPU, but the "
            f"Megatron roles keep {resident / GIB:.1f} GiB there while the engines generate (vLLM refuses to start "
            "unless its share is free)",
            f"use at most {most:.2f}, or offload more: actor.offload.params / grads / optimizer (and the critic's), "
            "ref.offload_params",
        )
    ]


def kv_cache_problems(config: Config, memory_gib: float) -> list[Problem]:
    """On CPU, where the estimate counts `rollout.kv_cache_gib`: a problem naming the largest KV cache
    that fits when the estimate fits without the cache but not with it (a recipe too large without
    any cache is the model's or the layout's problem, which the report shows). No problem when the
    model's shape is unknown."""
    if config.trainer.device != "cpu":
        return []
    try:
        dims, _ = load_model_dims(config.model.path)
    except ModelFactsError:
        return []
    kv = config.rollout.kv_cache_gib

    def peak(kv_cache_gib: float) -> int:
        sized = replace(config, rollout=replace(config.rollout, kv_cache_gib=kv_cache_gib))
        return estimate_memory(
            sized, dims, train_gpus=plan_batches(config).train_gpus, gpu_memory_gib=memory_gib, on_gpu=False
        ).peak_bytes

    budget, with_cache = int(memory_gib * GIB), peak(kv)
    if with_cache <= budget or peak(0) > budget:
        return []
    # The peak grows one for one with the cache once the cache's phase is the peak, as it is here.
    most = (budget - (with_cache - int(kv * GIB))) / GIB
    return [
        Problem(
            "rollout.kv_cache_gib",
            kv,
            f"the memory estimate (megarl validate's table) peaks at {with_cache / GIB:.1f} GiB with this cache, "
            f"more than the {memory_gib:g} GiB compared against (--gpu-memory-gib)",
            f"use at most {int(most * 10) / 10:g} GiB, or pass the machine's memory as --gpu-memory-gib",
        )
    ]
