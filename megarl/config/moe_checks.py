"""A mixture-of-experts model's settings (`megarl.config.validate`, `megarl.config.layout_checks`): the router
coefficients, the expert layout (EP | experts, expert TP | expert width, sequence parallelism when trained
at TP > 1), block recompute that would run a mixture of experts' layers without the padding mask, and every
expert setting on a dense model, each a problem naming its key."""

from megarl.config.config import Config
from megarl.config.engines import engine_capabilities, loads_per_rank
from megarl.config.problems import Problem
from megarl.config.role_checks import need
from megarl.config.roles import ActorConfig, ParallelConfig, RecomputeConfig
from megarl.config.rollout import RolloutConfig
from megarl.models.hf_config import ModelDims


def check_moe_settings(actor: ActorConfig, problems: list[Problem]) -> None:
    """The ranges of `actor.moe`'s router coefficients, whatever the model."""
    moe = actor.moe
    need(
        problems,
        moe.aux_loss_coeff is None or moe.aux_loss_coeff >= 0,
        "actor.moe.aux_loss_coeff",
        moe.aux_loss_coeff,
        "must be >= 0 (0 turns the load-balancing loss off)",
        "e.g. 0.001, or null for the checkpoint's router_aux_loss_coef",
    )
    need(
        problems,
        moe.z_loss_coeff is None or moe.z_loss_coeff > 0,
        "actor.moe.z_loss_coeff",
        moe.z_loss_coeff,
        "must be > 0",
        "e.g. 0.001, or null for no z-loss",
    )


def check_block_recompute(
    role: str,
    parallel: ParallelConfig,
    recompute: RecomputeConfig,
    dims: ModelDims,
    model: str,
    problems: list[Problem],
) -> None:
    """Full recompute by "block" of fewer layers than a model chunk holds, on a mixture of experts: megatron-core
    0.16 runs the layers it leaves alone without the padding mask (`TransformerBlock._checkpointed_forward`), so
    their routers would count the padding in their load-balancing losses and token counts (the mask
    `megarl.workers.megatron_train.run_model` passes for exactly that reason)."""
    if (
        not dims.num_experts
        or recompute.granularity != "full"
        or recompute.method != "block"
        or not recompute.num_layers
    ):
        return
    per_chunk = dims.num_layers // (
        parallel.pipeline_model_parallel_size * (parallel.virtual_pipeline_model_parallel_size or 1)
    )
    need(
        problems,
        recompute.num_layers >= per_chunk,
        f"{role}.recompute.num_layers",
        recompute.num_layers,
        f"block recompute of {recompute.num_layers} of the {per_chunk} layers each model chunk holds runs the others "
        "without the padding mask in megatron-core (TransformerBlock._checkpointed_forward), and "
        f"{model} is a mixture of experts: their routers would count padding tokens in their losses",
        f"use {role}.recompute.method: uniform, or {role}.recompute.num_layers: {per_chunk} (every layer)",
    )


def check_dense_router_settings(actor: ActorConfig, dims: ModelDims, model: str, problems: list[Problem]) -> None:
    """`actor.moe` router settings on a dense model: there is no router they could reach."""
    if dims.num_experts:
        return
    need(
        problems,
        not actor.moe.router_replay,
        "actor.moe.router_replay",
        True,
        f"{model} is dense (model_type {dims.model_type!r}, no experts): there is no routing to replay",
        "set actor.moe.router_replay: false",
    )
    for key, value in (
        ("actor.moe.aux_loss_coeff", actor.moe.aux_loss_coeff),
        ("actor.moe.z_loss_coeff", actor.moe.z_loss_coeff),
    ):
        need(
            problems,
            value is None,
            key,
            value,
            f"{model} is dense (model_type {dims.model_type!r}, no experts): there is no router to balance",
            f"remove {key} (null)",
        )


def check_rollout_expert_split(rollout: RolloutConfig, dims: ModelDims, model: str, problems: list[Problem]) -> None:
    """vLLM cuts every expert's intermediate dimension over the rollout TP ranks, or with expert parallelism
    (`rollout.expert_parallel`) places whole experts on them, one at least each; a dense model has none."""
    tp, expert = rollout.tensor_model_parallel_size, dims.moe_ffn_hidden_size
    if rollout.expert_parallel:
        need(
            problems,
            dims.num_experts > 0,
            "rollout.expert_parallel",
            True,
            f"{model} is dense (model_type {dims.model_type!r}, no experts): there are no experts to place",
            "set rollout.expert_parallel: false",
        )
        need(
            problems,
            engine_capabilities(rollout.backend).expert_parallel,
            "rollout.expert_parallel",
            True,
            f"rollout.backend={rollout.backend} generates on one device; expert parallelism is vLLM's",
            "set rollout.backend: vllm, or rollout.expert_parallel: false",
        )
        need(
            problems,
            not dims.num_experts or tp <= dims.num_experts,
            "rollout.tensor_model_parallel_size",
            tp,
            f"with rollout.expert_parallel vLLM places whole experts, at least one on each of the {tp} ranks, "
            f"and {model} has {dims.num_experts}",
            f"use a rollout TP of at most {dims.num_experts}",
        )
        return
    need(
        problems,
        not dims.num_experts or expert % tp == 0,
        "rollout.tensor_model_parallel_size",
        tp,
        f"vLLM cuts every expert over the rollout TP ranks, and rollout TP {tp} does not divide the expert "
        f"intermediate size {expert} (moe_intermediate_size) of {model}",
        f"use a rollout TP dividing {expert}, or rollout.expert_parallel: true (whole experts per rank)",
    )


def check_expert_layout(
    prefix: str, parallel: ParallelConfig, dims: ModelDims, model: str, problems: list[Problem], trained: bool
) -> None:
    """EP | experts and expert TP | expert width for a mixture-of-experts model; neither set for a dense one.
    A trained mixture of experts with TP > 1 needs sequence parallelism: without it every TP rank routes
    the same tokens to the experts, whose gradients would count each token TP times (Megatron-LM's
    arguments refuse MoE with TP > 1 and no --sequence-parallel)."""
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    ep_key, etp_key = f"{prefix}parallel.expert_model_parallel_size", f"{prefix}parallel.expert_tensor_parallel_size"
    experts, width = dims.num_experts, dims.moe_ffn_hidden_size
    if not experts:
        dense = f"{model} is dense (model_type {dims.model_type!r}, no experts)"
        need(problems, ep == 1, ep_key, ep, f"{dense}: expert parallelism splits experts", f"set {ep_key}: 1")
        need(problems, etp is None, etp_key, etp, f"{dense}: expert TP cuts experts", f"remove {etp_key} (null)")
        return
    tp = parallel.tensor_model_parallel_size
    sp_key = f"{prefix}parallel.sequence_parallel"
    need(
        problems,
        not trained or tp <= 1 or parallel.sequence_parallel,
        sp_key,
        False,
        f"{model} is a mixture of experts trained at TP {tp}: without sequence parallelism every TP rank would route "
        "the same tokens to the experts and their gradients would count each token TP times (Megatron-LM refuses "
        "MoE with TP > 1 without --sequence-parallel)",
        f"set {sp_key}: true",
    )
    if ep >= 1:
        need(
            problems,
            experts % ep == 0,
            ep_key,
            ep,
            f"EP {ep} does not divide the {experts} experts of {model} (each EP rank holds an equal share)",
            f"use an EP dividing {experts}",
        )
    etp = parallel.tensor_model_parallel_size if etp is None else etp
    if etp >= 1:
        need(
            problems,
            width % etp == 0,
            etp_key,
            etp,
            f"expert TP {etp} does not divide the expert intermediate size {width} (moe_intermediate_size) of {model}",
            f"use an expert TP dividing {width} (unset, it is the role's TP)",
        )


def check_expert_transport(config: Config, problems: list[Problem]) -> None:
    """Experts placed otherwise than the dense weights (actor EP > 1, expert TP ≠ TP, `rollout.expert_parallel`)
    reach the engines as the planner's pieces, each from the rank holding it to the worker holding it: through
    the collective transport's shard sync (`megarl.bridge.shard_sync`) or, loaded per rank by vLLM, through the
    rings (`megarl.bridge.scheduled_ring`); never as a rank's own shards or gathered HF tensors."""
    parallel, rollout = config.actor.parallel, config.rollout
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    split = [
        f"actor.parallel.expert_model_parallel_size={ep}" if ep > 1 else None,
        f"actor.parallel.expert_tensor_parallel_size={etp}"
        if etp not in (None, parallel.tensor_model_parallel_size)
        else None,
        "rollout.expert_parallel=true" if rollout.expert_parallel else None,
    ]
    split = [setting for setting in split if setting]
    if not split:
        return
    why = f"with {', '.join(split)} the experts lie on other ranks than the dense weights, and "
    need(
        problems,
        rollout.sync.transport in ("auto", "collective") or loads_per_rank(rollout),
        "rollout.sync.transport",
        rollout.sync.transport,
        why
        + "the shared transports carry them only as pieces the engines load per rank, which the "
        + (
            f"{rollout.backend} engine does not"
            if not engine_capabilities(rollout.backend).per_rank_load
            else "rollout.sync.per_rank: never forbids"
        ),
        "use rollout.sync.transport: auto (it picks the collective here) or collective",
    )
    need(
        problems,
        rollout.sync.per_rank != "always",
        "rollout.sync.per_rank",
        rollout.sync.per_rank,
        why + "a rank's own shards are not what any engine worker holds",
        "use rollout.sync.per_rank: auto",
    )
