"""HF config → megatron-core `TransformerConfig`, layer spec and `GPTModel` for one (TP, PP) rank.

The architecture of the config's `model_type` (`megarl.models.arch`) gives the architectural
TransformerConfig fields and the layer spec; this module adds what every architecture shares: the
parallel sizes, precision, RoPE arguments, the Transformer Engine mask type and the value head.
`transformer_impl` picks the layer spec: "local" (plain torch, runs on CPU) or "transformer_engine"
(GPU); the TransformerConfig is the same for both but for `apply_rope_fusion` (`rope_fusion`) and, for a
mixture of experts, `moe_grouped_gemm` (the TE spec's grouped-GEMM experts).
`params_dtype` bfloat16 gives bf16 parameters and compute (megatron's `bf16` TransformerConfig field
follows it); the fp32 main parameters and gradients of mixed precision belong to the trainer
(`megarl.workers.megatron_train`).

    groups = initialize_model_parallel(tp=2, pp=2, seed=0)
    model = build_gpt_model("/ckpt/qwen", groups)                  # actor / reference
    critic = build_gpt_model("/ckpt/qwen", groups, value_head=True)
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.arch import architecture
from megarl.models.hf_config import ModelDims, check_parallel_layout, read_model_dims
from megarl.models.layout import VOCAB_DIVISIBLE_BY, padded_vocab_size
from megarl.models.model_options import TORCH_DTYPES, TRANSFORMER_IMPLS
from megarl.parallel.device import uses_cuda
from megarl.parallel.distributed import ProcessGroups

TE_SELF_ATTENTION_MASK_TYPE = AttnMaskType.causal
"""The Transformer Engine spec's self-attention mask type: `causal`, which megatron's
`TEDotProductAttention.forward` (megatron/core/extensions/transformer_engine.py) turns into
`padding_causal` for `qkv_format="thd"`, the mask types TE's THD kernels take (flash attention or
cuDNN): causal inside each `cu_seqlens` sequence, no `attention_mask`. Every micro-batch reaches this
spec in the THD layout (`takes_thd`, `megarl.workers.thd`), so samples are never padded there and
left-padded prompts need no mask. (A dense mask, as the local spec takes, would need `arbitrary`,
which TE runs only in its unfused O(T^2) attention.) Set explicitly, not left to the spec function's
default, because the THD layout depends on it."""


CP_COMM_TYPE = "p2p"
"""How Transformer Engine's attention exchanges keys and values between CP ranks (TransformerConfig's
`cp_comm_type`, which megatron's `TEDotProductAttention.__init__` hands TE with `cp_group` and
`cp_global_ranks`): "p2p", a ring in which each rank passes its K/V chunks to the next while computing on
the ones it holds (TE's `AttnFuncWithCPAndKVP2P`, transformer_engine/pytorch/attention/
dot_product_attention/context_parallel.py). It is the one of TE's CP schemes that takes every micro-batch
in the THD layout, as the TE spec gets them (`takes_thd`): TE's KV all-gather and QKVO all-to-all do not
(its CP tests, tests/pytorch/attention/test_attention_with_cp.py, skip THD for "all_gather" and "a2a")."""


def takes_thd(config: TransformerConfig) -> bool:
    """Whether a model built with `config` takes its micro-batches in megatron-core's THD layout
    (`PackedSeqParams`, no attention mask): the Transformer Engine spec does (`TEDotProductAttention`);
    the local spec does not (its `DotProductAttention` refuses `packed_seq_params`), and gets the
    dense block-diagonal mask (`megarl.workers.micro_batches.MicroBatch.attention_mask`)."""
    return config.transformer_impl == "transformer_engine"


def rope_fusion(transformer_impl: str) -> bool:
    """TransformerConfig's `apply_rope_fusion` for a layer spec: on for Transformer Engine, off for local.

    Every micro-batch reaches the TE spec in the THD layout (`takes_thd`), and there megatron-core
    0.16.1's unfused RoPE (megatron/core/models/common/embeddings/rope_utils.py,
    `_apply_rotary_pos_emb_thd`) reads `cu_seqlens` on the host (`.tolist()` of the lengths and an
    `if` on `cu_seqlens[-1]`: GPU syncs) and slices the frequencies per sequence in a Python loop,
    for q and for k in every layer: the GPU waits for the host at every layer. With the
    flag, `rope_utils.apply_rotary_pos_emb` calls `fused_apply_rotary_pos_emb_thd(t, cu_seqlens,
    freqs, cp_size=..., cp_rank=...)` (megatron/core/extensions/transformer_engine.py), one TE kernel
    (transformer_engine/pytorch/attention/rope.py, `apply_rotary_pos_emb(..., tensor_format="thd",
    fused=True)`) with positions restarting at each sequence. Megatron-LM's training scripts turn it
    on by default (`--no-rope-fusion` turns it off).

    What the fused path needs, and megarl's models (Llama, Qwen2, Qwen3) meet: the fused functions
    importable (`TransformerConfig.__post_init__` raises "Please install TE >= 1.4" otherwise, hence
    off on the local spec, which runs where TE is not installed; the `gpu` extra pins TE 2.9, whose
    THD kernel also takes context parallelism, TE >= 1.12); `rotary_interleaved` False (the THD
    wrapper hands TE no `interleaved` flag; HF's Llama/Qwen rotate halves anyway); no YaRN `mscale`
    (the fused THD call drops it; a plain TransformerConfig has no YaRN fields, so it is 1.0); the
    llama3 and linear scalings (`rope_arguments`) live in the frequency table both paths read.
    """
    return transformer_impl == "transformer_engine"


TRAINING_DEFAULTS = frozenset({"moe_aux_loss_coeff"})
"""Architectural fields that are a checkpoint's default for a training setting (the load-balancing
coefficient of config.json's `router_aux_loss_coef`), which a role's settings (`actor.moe`) may replace."""


def transformer_config(
    dims: ModelDims,
    *,
    tp_size: int,
    pp_size: int,
    vpp_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    transformer_impl: str = "local",
    ep_size: int = 1,
    etp_size: int | None = None,
    cp_size: int = 1,
    **overrides: Any,
) -> TransformerConfig:
    """The TransformerConfig of `dims` on a (tp_size, pp_size) grid, with `vpp_size` virtual stages per
    PP rank (megatron's interleaved schedule; 1: none), experts split over `ep_size` ranks and each expert
    over `etp_size` (None: TP), and each sequence over `cp_size` ranks (context parallelism: Transformer
    Engine's attention only, `CP_COMM_TYPE`).

    params_dtype: float32 or bfloat16 (`TORCH_DTYPES`); megatron's `bf16` flag follows it.
    overrides: non-architectural TransformerConfig fields the caller owns (e.g. `sequence_parallel`,
    `recompute_granularity`); architectural fields, the precision fields and `apply_rope_fusion`
    (`rope_fusion` of `transformer_impl`) are rejected.
    """
    check_parallel_layout(dims, tp_size=tp_size, pp_size=pp_size, vpp_size=vpp_size, ep_size=ep_size, etp_size=etp_size)
    _check_impl(transformer_impl)
    if cp_size > 1 and transformer_impl != "transformer_engine":
        raise ValueError(
            f"context_parallel_size={cp_size} needs transformer_impl='transformer_engine' (got {transformer_impl!r}): "
            "megatron's local spec has no context-parallel attention (its DotProductAttention asserts "
            "context_parallel_size == 1); use the Transformer Engine spec or context_parallel_size 1"
        )
    architectural = architecture(dims.model_type).transformer_fields(dims)
    derived = {
        "bf16",
        "fp16",
        "params_dtype",
        "pipeline_dtype",
        "apply_rope_fusion",
        "virtual_pipeline_model_parallel_size",
        "batch_p2p_comm",
        "moe_grouped_gemm",
        "context_parallel_size",
        "cp_comm_type",
    }
    clashes = sorted(set(overrides) & (set(architectural) - TRAINING_DEFAULTS | derived))
    if clashes:
        raise ValueError(
            f"transformer_config: {clashes} come from the HF config.json, params_dtype or transformer_impl "
            "and cannot be overridden"
        )
    router_settings = sorted(name for name in overrides if name.startswith("moe_"))
    if router_settings and not dims.num_experts:
        raise ValueError(
            f"transformer_config: {router_settings} for a dense model (model_type={dims.model_type!r} "
            "has no experts); leave the MoE settings unset"
        )
    architectural = {name: value for name, value in architectural.items() if name not in overrides}
    _check_dtype(params_dtype)
    return TransformerConfig(
        **architectural,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vpp_size if vpp_size > 1 else None,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=tp_size if etp_size is None else etp_size,
        context_parallel_size=cp_size,
        cp_comm_type=CP_COMM_TYPE if cp_size > 1 else None,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        # Without CUDA, megatron must build full weights on the CPU and slice them per rank.
        use_cpu_initialization=not uses_cuda(),
        batch_p2p_comm=batch_p2p_comm(vpp_size),
        transformer_impl=transformer_impl,
        apply_rope_fusion=rope_fusion(transformer_impl),
        # The TE spec's experts are one grouped GEMM (`layer_spec_options` of a mixture of experts).
        moe_grouped_gemm=bool(dims.num_experts) and transformer_impl == "transformer_engine",
        **overrides,
    )


def batch_p2p_comm(vpp_size: int) -> bool:
    """TransformerConfig's `batch_p2p_comm`: megatron's default (True), except under the interleaved schedule
    on gloo. There, at PP 2, a rank's one neighbour is both its next and its previous stage, and a steady-state
    exchange sends it an activation and a gradient at once; megatron's batched exchange (`_batched_p2p_ops`,
    megatron/core/pipeline_parallel/p2p_communication.py) posts send-previous before send-next on every rank
    while the peer posts receive-previous first, and gloo pairs one peer's messages in posting order: the
    activation lands in the gradient's buffer (measured: the update's loss 0.63 instead of VPP off's 0.019,
    forward-only passes unaffected). The unbatched exchange (`_p2p_ops`) orders the posts by rank parity and
    puts the two directions on different groups, so they pair up right."""
    return uses_cuda() or vpp_size == 1


def resolve_transformer_impl(setting: str, device_type: str, dtype: str) -> str:
    """`model.transformer_impl` for a process whose compute device is `device_type` ("cuda"/"cpu") and
    whose model is in `dtype` (a `model.dtype`): "auto" is Transformer Engine on CUDA where it is
    importable and the model is not float32, else local.

    Why not float32: the TE spec always takes THD micro-batches (`takes_thd`), and TE has no float32
    attention for them: its backend selection (`get_attention_backend`, transformer_engine/pytorch/
    attention/dot_product_attention/utils.py) drops UnfusedDotProductAttention for qkv_format thd, and
    its flash and fused backends take fp16/bf16 only. An explicit "transformer_engine" in float32 is
    `megarl validate`'s to refuse (the CPU stand-in tests of the TE path run it in float32)."""
    if setting != "auto":
        _check_impl(setting)
        return setting
    return "transformer_engine" if device_type == "cuda" and dtype != "float32" and _te_importable() else "local"


def layer_spec(dims: ModelDims, transformer_impl: str = "local") -> ModuleSpec:
    """The decoder layer spec with the architecture's options: local (CPU) or Transformer Engine (GPU);
    the local one takes a dense attention mask, the TE one the THD layout (`TE_SELF_ATTENTION_MASK_TYPE`)."""
    _check_impl(transformer_impl)
    options = architecture(dims.model_type).layer_spec_options(dims, transformer_impl)
    if transformer_impl == "local":
        return get_gpt_layer_local_spec(**options)
    spec = get_gpt_layer_with_transformer_engine_spec(**options)
    return with_self_attention_mask_type(spec, TE_SELF_ATTENTION_MASK_TYPE)


def with_self_attention_mask_type(spec: ModuleSpec, mask_type: AttnMaskType) -> ModuleSpec:
    """`spec` (a TransformerLayer spec; both megatron GPT spec functions build the self-attention as
    `ModuleSpec(SelfAttention, params={"attn_mask_type": ...})`) with that mask type replaced."""
    attention = spec.submodules.self_attention
    attention.params = {**attention.params, "attn_mask_type": mask_type}
    return spec


def build_gpt_model(
    hf_config: Any,
    groups: ProcessGroups,
    *,
    transformer_impl: str = "local",
    params_dtype: torch.dtype = torch.float32,
    value_head: bool = False,
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY,
    vp_stage: int = 0,
    **config_overrides: Any,
) -> GPTModel:
    """This rank's `GPTModel` stage for an HF config (dir, config.json path, dict or PretrainedConfig);
    with virtual stages (`groups.vpp_size` > 1) its chunk `vp_stage` (`build_model_chunks` builds them all).

    Weights are random-init (on the current GPU when there is one), every parameter in `params_dtype`;
    load a checkpoint with `megarl.models.checkpoint.load_hf_weights`.
    Outputs of the last stage (`forward(input_ids [B, T], position_ids [B, T], attention_mask=None)`;
    None means plain causal on the local spec; with Transformer Engine, inputs are one THD row
    `[1, t]` with `packed_seq_params`, see `takes_thd`):
    - `value_head=False`: vocab-parallel logits [B, T, V_padded / TP]. Columns >= the HF vocab size are
      padding: mask them before a softmax over the full vocabulary.
    - `value_head=True`: values [B, T, 1] from a `ValueHead` (one scalar per token, replicated over
      TP) in place of the LM head; embeddings are never tied to it.
    Earlier stages return hidden states [T, B, H] for the pipeline schedule.
    """
    dims = read_model_dims(hf_config)
    config = transformer_config(
        dims,
        tp_size=groups.tp_size,
        pp_size=groups.pp_size,
        vpp_size=groups.vpp_size,
        ep_size=groups.ep_size,
        etp_size=groups.etp_size,
        cp_size=groups.cp_size,
        params_dtype=params_dtype,
        transformer_impl=transformer_impl,
        **config_overrides,
    )
    # The embedding lives in the model's first chunk, the head in its last.
    pre_process = groups.is_first_stage and vp_stage == 0
    post_process = groups.is_last_stage and vp_stage == groups.vpp_size - 1
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(dims, transformer_impl),
        vocab_size=padded_vocab_size(dims.vocab_size, vocab_divisible_by, groups.tp_size),
        max_sequence_length=dims.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=dims.tie_word_embeddings and not value_head,
        position_embedding_type="rope",
        **rope_arguments(dims),
        pg_collection=groups.collection,
        vp_stage=vp_stage if groups.vpp_size > 1 else None,
    )
    if value_head and post_process:
        model.output_layer = ValueHead(config, groups.tp)
    # Megatron's sharded layers honour params_dtype; torch-native ones (the local spec's norms) start
    # in fp32. This cast is what megatron's Float16Module does to the module it wraps; the wrapper's
    # other jobs are not needed here: the inputs are token ids and a bool mask, and the readers of
    # the outputs upcast them after slicing (`megarl.workers.logprobs`, the value readers).
    model.to(dtype=params_dtype)
    if uses_cuda():
        # Megatron allocates sharded weights on the GPU, but torch-native modules (norms) start on the CPU.
        model.cuda(torch.cuda.current_device())
    return model


def build_model_chunks(hf_config: Any, groups: ProcessGroups, **options: Any) -> list[GPTModel]:
    """This rank's model chunks, one per virtual stage in order (one without virtual stages): chunk v
    holds the layers `megarl.models.layout.layer_offset` gives it. `options`: `build_gpt_model`'s."""
    return [build_gpt_model(hf_config, groups, vp_stage=stage, **options) for stage in range(groups.vpp_size)]


def rope_arguments(dims: ModelDims) -> dict[str, Any]:
    """GPTModel's (and RotaryEmbedding's) RoPE arguments: base, llama3 scaling or linear interpolation."""
    rope = dims.rope_scaling
    return dict(
        rotary_base=dims.rope_theta,
        rope_scaling=rope is not None and rope.kind == "llama3",
        rope_scaling_factor=rope.factor if rope is not None and rope.kind == "llama3" else 8.0,
        seq_len_interpolation_factor=rope.factor if rope is not None and rope.kind == "linear" else None,
    )


class ValueHead(MegatronModule):
    """The critic's scalar head in place of `GPTModel.output_layer`: hidden [S, B, H] → values [S, B, 1].

    A plain (not vocab-parallel) `[1, H]` weight, replicated on every TP rank: the hidden states it
    reads are replicated too, so each rank computes the same values and gradients. Its state-dict
    name is `output_layer.weight`; it has no HF counterpart. Construction is a TP-group collective
    (TP rank 0's init is broadcast).
    """

    def __init__(self, config: TransformerConfig, tp_group: torch.distributed.ProcessGroup):
        super().__init__(config)
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype, device=device))
        config.init_method(self.weight)
        # Replicas must start equal whatever RNG draws each TP rank made before.
        torch.distributed.broadcast(
            self.weight.data, src=torch.distributed.get_global_rank(tp_group, 0), group=tp_group
        )

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        """Same call signature as `ColumnParallelLinear` (GPTModel's post-processing calls it so)."""
        if self.sequence_parallel:
            # Sequence-parallel hidden states are split over TP; the head is replicated, so its input
            # gradient is split back, not reduced.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return F.linear(hidden_states, self.weight), None


def _check_dtype(params_dtype: torch.dtype) -> None:
    if params_dtype not in TORCH_DTYPES.values():
        raise ValueError(
            f"params_dtype={params_dtype} (model.dtype): the Megatron roles train in {list(TORCH_DTYPES)}; "
            "use model.dtype: bfloat16 (fp16 needs loss scaling, which megarl's trainer does not run)"
        )


def _check_impl(transformer_impl: str) -> None:
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={transformer_impl!r} is not one of {list(TRANSFORMER_IMPLS)}")
    if transformer_impl == "transformer_engine" and not _te_importable():
        raise ValueError(
            "transformer_impl='transformer_engine' needs Transformer Engine (GPU images install it); "
            "use transformer_impl='local' on CPU"
        )


def _te_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None
