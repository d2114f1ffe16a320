"""Whether a role's (TP, PP, VPP) layout and the rollout TP can cut the model (`megarl.config.validate`, and
`megarl sft` for its top-level `parallel`): Megatron's and vLLM's divisibility rules, from the model's dims."""

from megarl.config.batch_plan import uses_reference
from megarl.config.config import Config
from megarl.config.moe_checks import (
    check_block_recompute,
    check_dense_router_settings,
    check_expert_layout,
    check_rollout_expert_split,
)
from megarl.config.problems import Problem
from megarl.config.role_checks import need
from megarl.config.roles import ParallelConfig, RecomputeConfig
from megarl.models.hf_config import ModelDims


def check_layout_against_model(config: Config, dims: ModelDims, source: str, problems: list[Problem]) -> None:
    """Megatron needs TP | heads, TP | KV groups, TP | MLP width and PP | layers; vLLM needs TP | heads, TP | MLP
    width and TP, KV heads nested. `source`: where `dims` were read (`load_model_dims`), named in the problems."""
    roles = {"actor": (config.actor.parallel, config.actor.recompute)}
    if config.critic.enable:
        roles["critic"] = (config.critic.parallel, config.critic.recompute)
    if uses_reference(config):
        roles["ref"] = (config.ref.parallel, None)
    model = f"the model ({source})"
    for role, (parallel, recompute) in roles.items():
        check_megatron_layout(role, parallel, recompute, dims, model, problems, trained=role != "ref")
        check_context_parallel_model(f"{role}.", parallel, dims, model, problems)
        if recompute is not None:
            check_block_recompute(role, parallel, recompute, dims, model, problems)
    check_dense_router_settings(config.actor, dims, model, problems)
    beyond = [stop for stop in config.rollout.stop if isinstance(stop, int) and stop >= dims.vocab_size]
    need(
        problems,
        not beyond,
        "rollout.stop",
        list(config.rollout.stop),
        f"token id(s) {beyond} lie beyond the vocabulary of {model}, ids 0 to {dims.vocab_size - 1}, so they "
        "could never be generated and never stop a response",
        "list token ids below the vocabulary size, or the stop text as a string",
    )
    tp, heads, kv = config.rollout.tensor_model_parallel_size, dims.num_attention_heads, dims.num_kv_heads
    ffn, key = dims.ffn_hidden_size, "rollout.tensor_model_parallel_size"
    if tp >= 1:
        need(
            problems,
            heads % tp == 0,
            key,
            tp,
            f"rollout TP {tp} does not divide the {heads} attention heads of {model}",
            f"use a rollout TP dividing {heads}",
        )
        need(
            problems,
            kv % tp == 0 or tp % kv == 0,
            key,
            tp,
            f"vLLM needs rollout TP {tp} and the {kv} KV heads of {model} to divide one another",
            f"use a rollout TP that divides {kv} or is a multiple of it",
        )
        need(
            problems,
            ffn % tp == 0,
            key,
            tp,
            _ffn_split("rollout TP", tp, ffn, model),
            f"use a rollout TP dividing {ffn}",
        )
        check_rollout_expert_split(config.rollout, dims, model, problems)


def _ffn_split(what: str, tp: int, ffn: int, model: str) -> str:
    """Why a TP that does not divide the MLP width fails: Megatron and vLLM alike give each TP rank an equal
    slice of the gate/up rows and of the down projection's columns."""
    return (
        f"{what} {tp} does not divide the MLP intermediate size {ffn} of {model} ({ffn} ÷ {tp} = {ffn / tp:.2f}): "
        "every TP rank holds an equal slice of the MLP"
    )


def check_context_parallel_model(
    prefix: str, parallel: ParallelConfig, dims: ModelDims, model: str, problems: list[Problem]
) -> None:
    """Context parallelism on a dense model only: megarl's router metrics and the expert sync count a
    mixture of experts' tokens per DP rank, and CP (which splits them over more ranks) is untested with them."""
    cp, key = parallel.context_parallel_size, f"{prefix}parallel.context_parallel_size"
    need(
        problems,
        cp <= 1 or not dims.num_experts,
        key,
        cp,
        f"{model} is a mixture of experts ({dims.num_experts} experts), and megarl runs context parallelism on dense "
        "models only (its expert paths are not proven with CP)",
        f"set {key}: 1 for this model",
    )


def check_megatron_layout(
    role: str,
    parallel: ParallelConfig,
    recompute: RecomputeConfig | None,
    dims: ModelDims,
    model: str,
    problems: list[Problem],
    trained: bool = True,
) -> None:
    """TP | heads, TP | KV groups, TP | MLP width, PP | layers (and recomputed layers within a stage) of `role`'s layout; `role`
    "" for a recipe whose `parallel` section is top-level (`megarl sft`)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    prefix = f"{role}." if role else ""
    heads, kv, layers = dims.num_attention_heads, dims.num_kv_heads, dims.num_layers
    if tp >= 1:
        key = f"{prefix}parallel.tensor_model_parallel_size"
        need(
            problems,
            heads % tp == 0,
            key,
            tp,
            f"TP {tp} does not divide the {heads} attention heads of {model}",
            f"use a TP dividing {heads}",
        )
        need(
            problems,
            kv % tp == 0,
            key,
            tp,
            f"Megatron needs TP {tp} to divide the {kv} KV groups of {model} ({kv} ÷ {tp} = {kv / tp:.2f})",
            f"use a TP dividing {kv}",
        )
        ffn = dims.ffn_hidden_size
        need(problems, ffn % tp == 0, key, tp, _ffn_split("TP", tp, ffn, model), f"use a TP dividing {ffn}")
    check_expert_layout(prefix, parallel, dims, model, problems, trained)
    if pp >= 1:
        need(
            problems,
            layers % pp == 0,
            f"{prefix}parallel.pipeline_model_parallel_size",
            pp,
            f"PP {pp} does not divide the {layers} layers of {model} ({layers} ÷ {pp} = {layers / pp:.2f})",
            f"use a PP dividing {layers}",
        )
        vpp = parallel.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp >= 2 and layers % pp == 0:
            need(
                problems,
                layers % (pp * vpp) == 0,
                f"{prefix}parallel.virtual_pipeline_model_parallel_size",
                vpp,
                f"PP {pp} × VPP {vpp} = {pp * vpp} chunks do not divide the {layers} layers of {model}",
                f"use a VPP dividing {layers // pp} (the layers of a pipeline stage)",
            )
        if (
            recompute is not None
            and recompute.num_layers is not None
            and layers % pp == 0
            and recompute.num_layers >= 1
        ):
            per_stage = layers // pp
            need(
                problems,
                recompute.num_layers <= per_stage,
                f"{prefix}recompute.num_layers",
                recompute.num_layers,
                f"more than the {per_stage} layers of a pipeline stage ({layers} layers ÷ PP {pp})",
                f"use 1 to {per_stage}",
            )
