"""`format_plan`: a recipe's `BatchPlan` as the plain-text table `megarl validate` prints (the step, the
devices, each Megatron role's layout and batch sizes, the processes per GPU, and one line per parallelism
in use)."""

from __future__ import annotations

from megarl.config.batch_plan import BatchPlan


def _process_lines(plan: BatchPlan) -> list[str]:
    """Which processes each Megatron role runs in."""
    shared = [r.role for r in (plan.actor, plan.critic, plan.ref) if r is not None and not r.own_group]
    lines = [f"processes: {', '.join(shared)} in the actor's group ({plan.train_gpus} processes, one per training GPU)"]
    actor = plan.actor
    for role in plan.own_groups:
        why = "its layout differs from the actor's" if role.grid != actor.grid else "ref.colocate_with_actor: false"
        lines.append(
            f"           {role.role} in a group of its own ({plan.train_gpus} processes on the same GPUs, "
            f"TP {role.tensor_parallel} × PP {role.pipeline_parallel} × DP {role.data_parallel}: {why})"
        )
    megatron = 1 + len(plan.own_groups)
    engine = "1 rollout engine" if plan.rollout_tp == 1 else f"1 TP worker of a {plan.rollout_tp}-GPU rollout engine"
    lines.append(
        f"           {plan.processes_per_train_gpu} processes per training GPU: {megatron} Megatron, {engine}"
        if plan.colocated
        else f"           {megatron} Megatron process{'es' if megatron > 1 else ''} per training GPU "
        "(the rollout engines have GPUs of their own)"
    )
    return lines


def _old_log_prob_line(plan: BatchPlan) -> str:
    if plan.old_log_prob_pass:
        return f"old log-probs: separate forward pass ({'; '.join(plan.old_log_prob_pass)})"
    return "old log-probs: from the update's forward (exactly on-policy: 1 mini-batch × 1 epoch)"


def format_plan(plan: BatchPlan) -> str:
    """The plan as a plain-text table (what `megarl validate` prints)."""
    lines = [
        f"step:     {plan.prompts_per_step} prompts × {plan.samples_per_prompt} samples = {plan.samples_per_step} samples",
        f"devices:  {plan.world_size} GPUs: {plan.train_gpus} training, {plan.rollout_gpus} rollout"
        + (" (colocated: the same GPUs)" if plan.colocated else ""),
        f"rollout:  {plan.rollout_gpus} GPUs ÷ TP {plan.rollout_tp} = {plan.rollout_engines} engines, "
        f"{plan.samples_per_engine} samples each",
        "",
        f"{'role':<7}{'TP':>4}{'PP':>4}{'DP':>4}  {'samples/rank':>12}  {'micro':>7}  {'fwd micro':>9}  "
        f"{'mini (prompts/samples/per rank)':>31}  {'grad acc':>8}  {'opt steps':>9}",
    ]
    for role in (plan.actor, plan.critic, plan.ref):
        if role is None:
            continue
        update = role.update
        mini = (
            f"{update.mini_batch_prompts}/{update.mini_batch_samples}/{update.samples_per_rank}"
            if update
            else "- (no training)"
        )
        # Packed micro-batches: "≤N t" tokens each, their number set by the data ("by tok").
        micro = (
            role.micro_batch_size if role.max_tokens_per_micro_batch is None else f"≤{role.max_tokens_per_micro_batch}t"
        )
        forward = role.forward_micro_batches or "by tok"
        accumulation = "-" if update is None else update.grad_accumulation_steps or "by tok"
        lines.append(
            f"{role.role:<7}{role.tensor_parallel:>4}{role.pipeline_parallel:>4}{role.data_parallel:>4}  "
            f"{role.samples_per_rank:>12}  {micro:>7}  {forward:>9}  {mini:>31}  "
            f"{accumulation:>8}  {update.optimizer_steps_per_step if update else '-':>9}"
        )
    lines += ["", *_process_lines(plan), _old_log_prob_line(plan)]
    split = [
        f"{role.role} (TP {role.tensor_parallel})"
        for role in (plan.actor, plan.critic, plan.ref)
        if role is not None and role.sequence_parallel
    ]
    if split:
        lines.append(f"sequence parallel: {', '.join(split)}; micro-batch rows padded to a multiple of TP")
    context = [
        f"{role.role} (CP {role.context_parallel})"
        for role in (plan.actor, plan.critic, plan.ref)
        if role is not None and role.context_parallel > 1
    ]
    if context:
        lines.append(
            f"context parallel: {', '.join(context)}; each sequence split over CP ranks in 2 × CP chunks (samples "
            "padded to a multiple of 2 × CP tokens); DP = GPUs ÷ (TP × CP × PP)"
        )
    virtual = [
        f"{role.role} (PP {role.pipeline_parallel} × VPP {role.virtual_pipeline}: "
        f"{role.pipeline_parallel * role.virtual_pipeline} chunks)"
        for role in (plan.actor, plan.critic, plan.ref)
        if role is not None and role.virtual_pipeline > 1
    ]
    if virtual:
        lines.append(f"virtual pipeline: {', '.join(virtual)}; megatron's interleaved 1F1B schedule")
    experts = [
        f"{role.role} (expert TP {role.expert_tensor_parallel} × EP {role.expert_parallel} × expert DP "
        f"{plan.train_gpus // (role.pipeline_parallel * role.expert_tensor_parallel * role.expert_parallel)})"
        for role in (plan.actor, plan.critic, plan.ref)
        if role is not None and (role.expert_parallel, role.expert_tensor_parallel) != (1, role.tensor_parallel)
    ]
    if experts:
        lines.append(f"experts: {', '.join(experts)} per pipeline stage")
    if plan.critic is None:
        lines.append("critic: none (critic.enable: false)")
    if plan.ref is None:
        lines.append("ref:    none (no KL term: actor.use_kl_loss and algorithm.use_kl_in_reward are false)")
    return "\n".join(lines)
