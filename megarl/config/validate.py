"""Semantic validation of a loaded `Config`: every problem at once, each naming the key, value, reason and fix.

Runs before anything starts: no Ray, no processes, no model load (only the model's config.json, the
tokenizer's vocabulary files and the manifest of a `checkpoint.resume` checkpoint are read). With
`check_files=False` (`megarl validate --no-file-checks`) the local filesystem is not consulted (data files, model/tokenizer/reward-model directories, checkpoint and output directories,
resume path, the local HF cache): for recipes meant for another machine. Model-shape checks then use a
hub id's known facts when there are some and are otherwise skipped. With file checks on, a hub id
must be in the local HF cache (megarl.config.hub): nothing is downloaded at run time.
"""

import os
from collections.abc import Sequence
from pathlib import Path

from megarl.config import names
from megarl.config.batch_plan import batch_problems, uses_reference
from megarl.config.config import Config
from megarl.config.hub import cached_snapshot, hub_values, is_hub_id, missing_from_cache
from megarl.config.layout_checks import check_layout_against_model
from megarl.config.loader import load_config
from megarl.config.model_facts import ModelFactsError, load_model_dims
from megarl.config.moe_checks import check_expert_transport, check_moe_settings
from megarl.config.placement import placement_problems
from megarl.config.problems import ConfigError, Problem, non_ascii_note
from megarl.config.resources import (
    data_file_problems,
    local_path,
    reward_function_problem,
    unusable_path,
)
from megarl.config.role_checks import (
    check_context_parallel,
    check_cpu_offload,
    check_optimizer,
    check_sequence_parallel,
    check_virtual_pipeline,
)
from megarl.config.role_checks import need as _need
from megarl.config.roles import RecomputeConfig
from megarl.config.rollout import response_length
from megarl.config.rollout_checks import check_rollout, check_rollout_correction
from megarl.config.run_checks import check_profile, check_seeds, check_trainer
from megarl.config.sections import RewardConfig
from megarl.config.token_budget import sample_token_bound, token_budget
from megarl.config.tokenizer_files import chat_template_problem, tokenizer_problems
from megarl.models.hf_config import ModelDims, load_hf_config
from megarl.tools.validation import tool_problems


def checked_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Load a recipe with its overrides and validate it; raises `ConfigError` listing every problem."""
    config = load_config(path, overrides)
    problems = validate(config)
    if problems:
        raise ConfigError(problems)
    return config


def validate(config: Config, check_files: bool = True) -> list[Problem]:
    """Every problem of `config`; an empty list means it can run. `config` is not modified."""
    problems: list[Problem] = []
    uncached = _uncached_hub_ids(config) if check_files else {}
    problems += [missing_from_cache(key, repo_id) for key, repo_id in uncached.items()]
    model = _model_dims(config, check_files and "model.path" not in uncached, problems)
    dims = model[0] if model is not None else None
    _check_model(config, check_files, problems)
    if model is not None:
        _check_causal_lm(config, model[1], problems)
    if check_files:
        _check_tokenizer(config, model, problems)
    _check_actor(config, problems)
    _check_critic(config, problems)
    _check_role_parallel(config, problems)
    check_rollout(config, problems)
    _check_algorithm(config, problems)
    _check_data(config, dims, check_files, problems)
    _check_reward(config, check_files, problems)
    problems += tool_problems(config.rollout.multi_turn, check_files)
    check_trainer(config, check_files, problems)
    check_profile(config, check_files, problems)
    check_seeds(config, problems)
    problems += batch_problems(config)
    problems += placement_problems(config, config.trainer.device)
    if model is not None:
        check_layout_against_model(config, *model, problems)
    return problems


def _uncached_hub_ids(config: Config) -> dict[str, str]:
    """The hub ids of `config` (by key) that are not in the local HF cache."""
    return {key: repo_id for key, repo_id in hub_values(config).items() if cached_snapshot(repo_id) is None}


def _model_dims(config: Config, check_files: bool, problems: list[Problem]) -> tuple[ModelDims, str] | None:
    """The model's dims and where they were read (`load_model_dims`), or None (a problem is added unless file
    checks are off)."""
    try:
        return load_model_dims(config.model.path)
    except ModelFactsError as error:
        if check_files or not config.model.path:
            problems.append(Problem("model.path", config.model.path, error.why, error.fix))
        return None


def _need_name(problems: list[Problem], key: str, value: str, valid: tuple[str, ...], what: str) -> None:
    _need(
        problems, value in valid, key, value, f"unknown {what}{non_ascii_note(value)}", f"use one of {', '.join(valid)}"
    )


def _check_model(config: Config, check_files: bool, problems: list[Problem]) -> None:
    model = config.model
    _need(
        problems,
        not model.trust_remote_code,
        "model.trust_remote_code",
        True,
        "megarl builds models from config.json and never runs code shipped with a checkpoint",
        "set model.trust_remote_code=false and use a supported architecture",
    )
    _need(
        problems,
        not (model.transformer_impl == "transformer_engine" and config.trainer.device == "cpu"),
        "model.transformer_impl",
        model.transformer_impl,
        "Transformer Engine is CUDA-only and trainer.device is cpu",
        "use transformer_impl auto or local on CPU",
    )
    _need(
        problems,
        not (model.transformer_impl == "transformer_engine" and model.dtype == "float32"),
        "model.transformer_impl",
        model.transformer_impl,
        "Transformer Engine has no float32 attention for the THD micro-batches its spec takes (model.dtype is float32)",
        "use model.dtype: bfloat16, or model.transformer_impl: auto (the local spec in float32)",
    )
    for role in ("actor", "critic"):
        _need(
            problems,
            not (getattr(config, role).offload.optimizer and model.dtype == "float32"),
            f"{role}.offload.optimizer",
            True,
            "megatron's optimizer offload moves the optimizer's parameters, which with float32 parameters are "
            "the model's own (inside DDP's buffer); only bfloat16 training has a separate fp32 copy to offload",
            f"use model.dtype: bfloat16, or set {role}.offload.optimizer: false",
        )
        _need(
            problems,
            not (getattr(config, role).offload.params and not getattr(config, role).optim.use_distributed_optimizer),
            f"{role}.offload.params",
            True,
            "megatron keeps the parameters in DDP's contiguous buffer (what the offload moves) only with the "
            "distributed optimizer: without it nothing would leave the GPU",
            f"set {role}.optim.use_distributed_optimizer: true, or {role}.offload.params: false",
        )
    tokenizer = model.tokenizer_path
    if check_files and tokenizer is not None and not os.path.isdir(local_path(tokenizer)) and not is_hub_id(tokenizer):
        why = (
            "is a file, not a directory"
            if os.path.isfile(local_path(tokenizer))
            else unusable_path(tokenizer) or "directory does not exist"
        )
        problems.append(
            Problem(
                "model.tokenizer_path",
                tokenizer,
                why,
                "point it at a tokenizer directory, or remove it to use model.path",
            )
        )


def _check_causal_lm(config: Config, source: str, problems: list[Problem]) -> None:
    """model.path, whose dims were read from `source`, is a causal LM: a `*ForSequenceClassification` checkpoint
    of the same model type (a reward model) has the same dims but a score head instead of the LM head the policy samples from."""
    if not source.endswith("config.json"):
        return  # the known-models table lists causal LMs only
    architectures = load_hf_config(source).get("architectures") or []
    architectures = [architectures] if isinstance(architectures, str) else architectures
    others = [name for name in architectures if not (isinstance(name, str) and name.endswith("ForCausalLM"))]
    _need(
        problems,
        not others,
        "model.path",
        config.model.path,
        f"{source} describes {others}, not a causal LM (*ForCausalLM): the policy generates with the LM head",
        "point model.path at the causal LM checkpoint (a *ForSequenceClassification one is a reward model: set "
        "it as reward.reward_model)",
    )


def _check_tokenizer(config: Config, model: tuple[ModelDims, str] | None, problems: list[Problem]) -> None:
    """The tokenizer the trainer will load (model.tokenizer_path, else model.path) holds a vocabulary that fits
    the model, and a chat template when data.chat_template is true. A missing directory or uncached hub id is
    reported by its own check."""
    key = "model.tokenizer_path" if config.model.tokenizer_path else "model.path"
    value = config.model.tokenizer_path or config.model.path
    if key == "model.path" and model is None:
        return  # model.path is no usable checkpoint: its own problem says why
    directory = cached_snapshot(value) if is_hub_id(value) else local_path(value)
    if directory is not None and os.path.isdir(directory):
        problems += tokenizer_problems(key, value, directory, model)
        if config.data.chat_template is True:
            problem = chat_template_problem(key, value, directory)
            if problem is not None:
                problems.append(problem)


def _check_recompute(prefix: str, recompute: RecomputeConfig, problems: list[Problem]) -> None:
    if recompute.granularity == "full":
        _need(
            problems,
            recompute.num_layers is not None and recompute.num_layers >= 1,
            f"{prefix}.num_layers",
            recompute.num_layers,
            "full recomputation needs the number of layers per recomputed chunk",
            "set it to 1 or more",
        )
    else:
        _need(
            problems,
            recompute.num_layers is None,
            f"{prefix}.num_layers",
            recompute.num_layers,
            f"only used with granularity full (granularity is {recompute.granularity})",
            "remove it, or set granularity: full",
        )


def _check_actor(config: Config, problems: list[Problem]) -> None:
    actor = config.actor
    check_optimizer("actor.optim", actor.optim, problems)
    check_cpu_offload("actor.optim", actor.optim, config.model.dtype, problems, actor.offload.optimizer)
    _check_recompute("actor.recompute", actor.recompute, problems)
    _need_name(problems, "actor.policy_loss", actor.policy_loss, names.policy_losses(), "policy loss")
    _need_name(problems, "actor.loss_agg_mode", actor.loss_agg_mode, names.loss_agg_modes(), "loss aggregation")
    _need_name(problems, "actor.kl_loss_type", actor.kl_loss_type, names.kl_estimators(), "KL estimator")
    _need(
        problems,
        0 < actor.clip_ratio_low < 1,
        "actor.clip_ratio_low",
        actor.clip_ratio_low,
        "must lie in (0, 1): the ratio is clipped at 1 - clip_ratio_low",
        "e.g. 0.2",
    )
    _need(
        problems,
        actor.clip_ratio_high > 0,
        "actor.clip_ratio_high",
        actor.clip_ratio_high,
        "must be > 0: the ratio is clipped at 1 + clip_ratio_high",
        "e.g. 0.2 (DAPO clip-higher: 0.28)",
    )
    _need(
        problems,
        actor.clip_ratio_c > 1,
        "actor.clip_ratio_c",
        actor.clip_ratio_c,
        "the dual-clip bound must be > 1",
        "e.g. 3.0",
    )
    _need(problems, actor.entropy_coeff >= 0, "actor.entropy_coeff", actor.entropy_coeff, "must be >= 0", "e.g. 0")
    _need(problems, actor.kl_loss_coef >= 0, "actor.kl_loss_coef", actor.kl_loss_coef, "must be >= 0", "e.g. 0.001")
    check_rollout_correction(actor.rollout_correction, problems)
    check_moe_settings(actor, problems)
    check_expert_transport(config, problems)


def _check_critic(config: Config, problems: list[Problem]) -> None:
    critic, estimator = config.critic, config.algorithm.adv_estimator
    if estimator in names.CRITIC_ESTIMATORS:
        _need(
            problems,
            critic.enable,
            "critic.enable",
            critic.enable,
            f"adv_estimator {estimator} needs a critic",
            "set critic.enable=true, or use a critic-free estimator such as grpo",
        )
    else:
        _need(
            problems,
            not critic.enable,
            "critic.enable",
            critic.enable,
            f"adv_estimator {estimator} is critic-free, so the critic would be trained and never used",
            "set critic.enable=false, or algorithm.adv_estimator=gae",
        )
    if not critic.enable:
        return
    check_optimizer("critic.optim", critic.optim, problems)
    check_cpu_offload("critic.optim", critic.optim, config.model.dtype, problems, critic.offload.optimizer)
    _check_recompute("critic.recompute", critic.recompute, problems)
    _need_name(problems, "critic.loss_agg_mode", critic.loss_agg_mode, names.loss_agg_modes(), "loss aggregation")
    _need(
        problems,
        critic.cliprange_value > 0,
        "critic.cliprange_value",
        critic.cliprange_value,
        "must be > 0",
        "e.g. 0.5",
    )
    _need(problems, critic.warmup_steps >= 0, "critic.warmup_steps", critic.warmup_steps, "must be >= 0", "e.g. 0")


def _check_role_parallel(config: Config, problems: list[Problem]) -> None:
    """Each Megatron role that runs: the actor, the critic when enabled, the reference when a KL term reads it."""
    roles = {"actor": config.actor.parallel}
    if config.critic.enable:
        roles["critic"] = config.critic.parallel
    if uses_reference(config):
        roles["ref"] = config.ref.parallel
    for role, parallel in roles.items():
        check_sequence_parallel(f"{role}.", parallel, problems)
        check_virtual_pipeline(f"{role}.", parallel, problems)
        section = getattr(config, role)
        budgets = {f"{role}.max_tokens_per_micro_batch": token_budget(section, sample_token_bound(config))}
        if role != "ref":
            budgets[f"{role}.forward_max_tokens_per_micro_batch"] = section.forward_max_tokens_per_micro_batch
        check_context_parallel(f"{role}.", parallel, config.model.transformer_impl, budgets, problems)


def _check_algorithm(config: Config, problems: list[Problem]) -> None:
    algorithm, n = config.algorithm, config.rollout.n
    _need_name(
        problems,
        "algorithm.adv_estimator",
        algorithm.adv_estimator,
        names.advantage_estimators(),
        "advantage estimator",
    )
    _need_name(problems, "algorithm.kl_penalty", algorithm.kl_penalty, names.kl_estimators(), "KL estimator")
    _need(problems, 0 <= algorithm.gamma <= 1, "algorithm.gamma", algorithm.gamma, "must lie in [0, 1]", "e.g. 1.0")
    _need(problems, 0 <= algorithm.lam <= 1, "algorithm.lam", algorithm.lam, "must lie in [0, 1]", "e.g. 0.95")
    if algorithm.adv_estimator in names.GROUP_ESTIMATORS:
        _need(
            problems,
            n >= 2,
            "rollout.n",
            n,
            f"{algorithm.adv_estimator} compares the samples of a prompt with each other, so it needs at least 2",
            "set rollout.n to 2 or more (e.g. 8)",
        )
    _need(
        problems,
        not (algorithm.adv_estimator == "remax" and config.reward.reward_model),
        "reward.reward_model",
        config.reward.reward_model,
        "remax's greedy baseline is scored by reward.function only, so a reward model's "
        "score would be in the samples' rewards but not in the baseline",
        "remove reward.reward_model, or use another estimator (e.g. grpo)",
    )
    kl_ctrl = algorithm.kl_ctrl
    _need(problems, kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", kl_ctrl.kl_coef, "must be >= 0", "e.g. 0.001")
    _need(problems, kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl", kl_ctrl.target_kl, "must be > 0", "e.g. 0.1")
    _need(problems, kl_ctrl.horizon >= 1, "algorithm.kl_ctrl.horizon", kl_ctrl.horizon, "must be >= 1", "e.g. 10000")
    sampling = algorithm.dynamic_sampling
    _need(
        problems,
        sampling.max_rounds >= 1,
        "algorithm.dynamic_sampling.max_rounds",
        sampling.max_rounds,
        "must be >= 1",
        "e.g. 10",
    )
    if sampling.enable:
        _need(
            problems,
            n >= 2,
            "algorithm.dynamic_sampling.enable",
            True,
            f"dynamic sampling drops prompts whose samples all score the same; with rollout.n = {n} every prompt "
            "would be dropped",
            "set rollout.n to 2 or more, or disable dynamic sampling",
        )
    overlong = algorithm.overlong
    if overlong.enable:
        _need(
            problems,
            1 <= overlong.buffer_length < config.rollout.max_new_tokens,
            "algorithm.overlong.buffer_length",
            overlong.buffer_length,
            f"the penalty ramp must fit inside the response budget "
            f"(rollout.max_new_tokens = {config.rollout.max_new_tokens})",
            f"choose 1 to {config.rollout.max_new_tokens - 1} tokens",
        )
        _need(
            problems,
            overlong.penalty_factor >= 0,
            "algorithm.overlong.penalty_factor",
            overlong.penalty_factor,
            "must be >= 0",
            "e.g. 1.0",
        )
    rollout = config.rollout
    _need(
        problems,
        not (
            overlong.filter_truncated
            and not rollout.multi_turn.enable
            and rollout.min_new_tokens >= rollout.max_new_tokens >= 1
        ),
        "algorithm.overlong.filter_truncated",
        True,
        f"rollout.min_new_tokens = rollout.max_new_tokens = {rollout.max_new_tokens}: no stop token can come before "
        "the limit, so every response is cut there and every sample would leave the actor's loss",
        "lower rollout.min_new_tokens, or set algorithm.overlong.filter_truncated: false",
    )


def _check_data(config: Config, dims: ModelDims | None, check_files: bool, problems: list[Problem]) -> None:
    data = config.data
    _need(
        problems,
        len(data.train_files) > 0,
        "data.train_files",
        list(data.train_files),
        "no training data",
        "list the training files, e.g. data.train_files=[train.jsonl]",
    )
    problems += data_file_problems("data.train_files", data.train_files, check_files)
    problems += data_file_problems("data.val_files", data.val_files, check_files)
    _need(problems, data.prompt_key != "", "data.prompt_key", data.prompt_key, "must name a column", "e.g. prompt")
    _need(problems, data.answer_key != "", "data.answer_key", data.answer_key, "must name a column", "e.g. answer")
    _need(
        problems,
        data.prompt_key != data.answer_key,
        "data.prompt_key",
        data.prompt_key,
        "is also data.answer_key, so the reward function would be handed each prompt as its reference answer",
        "name the prompt column in data.prompt_key and the answer column in data.answer_key",
    )
    _need(
        problems,
        data.chat_template != "",
        "data.chat_template",
        data.chat_template,
        "an empty template renders nothing",
        "use true (the tokenizer's template), false, or a Jinja template",
    )
    _need(
        problems,
        data.max_prompt_length >= 1,
        "data.max_prompt_length",
        data.max_prompt_length,
        "must be >= 1",
        "e.g. 512",
    )
    _need(
        problems,
        data.val_batch_size is None or data.val_batch_size >= 1,
        "data.val_batch_size",
        data.val_batch_size,
        "must be >= 1",
        "e.g. 256, or null for the whole validation set",
    )
    if dims is not None:
        width = response_length(config.rollout)
        key = "rollout.multi_turn.max_total_tokens" if config.rollout.multi_turn.enable else "rollout.max_new_tokens"
        total = data.max_prompt_length + width
        _need(
            problems,
            total <= dims.max_position_embeddings,
            key,
            width,
            f"data.max_prompt_length {data.max_prompt_length} + {key.rsplit('.', 1)[-1]} {width} = "
            f"{total} tokens exceed the model's max_position_embeddings {dims.max_position_embeddings}",
            f"keep prompt + response within {dims.max_position_embeddings} tokens",
        )


def _check_reward_sandbox(reward: RewardConfig, problems: list[Problem]) -> None:
    sandbox = reward.sandbox
    _need(
        problems,
        sandbox.case_timeout_s > 0,
        "reward.sandbox.case_timeout_s",
        sandbox.case_timeout_s,
        "must be > 0 seconds",
        "e.g. 4",
    )
    if reward.function == "code":
        _need(
            problems,
            sandbox.case_timeout_s < reward.timeout_s,
            "reward.sandbox.case_timeout_s",
            sandbox.case_timeout_s,
            f"must be below reward.timeout_s ({reward.timeout_s:g} s): a response's test cases all run within that",
            "lower it, or raise reward.timeout_s",
        )
    if not sandbox.sandbox_fusion_url:
        return
    _need(
        problems,
        sandbox.sandbox_fusion_url.startswith(("http://", "https://")),
        "reward.sandbox.sandbox_fusion_url",
        sandbox.sandbox_fusion_url,
        "not an http(s) URL",
        "write the SandboxFusion server's base URL, e.g. http://127.0.0.1:8080",
    )
    _need(
        problems,
        not sandbox.unsafe_no_sandbox,
        "reward.sandbox.unsafe_no_sandbox",
        True,
        "the programs run on the SandboxFusion server (reward.sandbox.sandbox_fusion_url), never locally, so "
        "nothing reads it",
        "remove it, or empty reward.sandbox.sandbox_fusion_url to run the programs locally",
    )


def _check_reward(config: Config, check_files: bool, problems: list[Problem]) -> None:
    reward = config.reward
    if ":" in reward.function:
        problem = reward_function_problem("reward.function", reward.function)
        if problem is not None:
            problems.append(problem)
    else:
        _need(
            problems,
            reward.function in names.BUILTIN_REWARDS,
            "reward.function",
            reward.function,
            f"neither a built-in reward nor `pkg.module:function`{non_ascii_note(reward.function)}",
            f"use one of {', '.join(names.BUILTIN_REWARDS)} or a function path like my_pkg.rewards:score",
        )
    _need(problems, reward.timeout_s > 0, "reward.timeout_s", reward.timeout_s, "must be > 0 seconds", "e.g. 10")
    _need(
        problems,
        0 < reward.max_failed_fraction <= 1,
        "reward.max_failed_fraction",
        reward.max_failed_fraction,
        "must lie in (0, 1] (1: never stop for a failing function)",
        "e.g. 0.5",
    )
    _need(
        problems,
        reward.failure_window >= 1,
        "reward.failure_window",
        reward.failure_window,
        "must be >= 1 training step",
        "e.g. 10",
    )
    _check_reward_sandbox(reward, problems)
    if check_files and reward.reward_model is not None and not is_hub_id(reward.reward_model):  # hub ids: above
        _need(
            problems,
            os.path.isfile(local_path(reward.reward_model) / "config.json"),
            "reward.reward_model",
            reward.reward_model,
            unusable_path(reward.reward_model) or "not an HF checkpoint directory (no config.json)",
            "point it at a reward model directory",
        )
