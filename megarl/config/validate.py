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
from megarl.config.batch_plan import batch_problems, plan_batches, uses_reference
from megarl.config.config import Config
from megarl.config.hub import cached_snapshot, hub_values, is_hub_id, missing_from_cache
from megarl.config.loader import load_config
from megarl.config.model_facts import ModelFacts, ModelFactsError, load_model_facts
from megarl.config.placement import placement_problems
from megarl.config.problems import ConfigError, Problem, non_ascii_note
from megarl.config.resources import (
    data_file_problems,
    local_path,
    reward_function_problem,
    unusable_path,
    writable_dir_problem,
)
from megarl.config.role_checks import check_cpu_offload, check_optimizer, check_sequence_parallel
from megarl.config.role_checks import need as _need
from megarl.config.rollout import response_length
from megarl.config.roles import ParallelConfig, RecomputeConfig, RolloutCorrectionConfig
from megarl.config.tokenizer_files import chat_template_problem, tokenizer_problems
from megarl.models.hf_config import load_hf_config
from megarl.tools.validation import tool_problems
from megarl.workers.checkpoint_files import STEP_DIR, CheckpointError, read_manifest

MIN_HANG_TIMEOUT_S = 10.0
"""The shortest trainer.hang_timeout_s: ten missed heartbeats."""


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
    facts = _model_facts(config, check_files and "model.path" not in uncached, problems)
    _check_model(config, check_files, problems)
    if facts is not None:
        _check_causal_lm(config, facts, problems)
    if check_files:
        _check_tokenizer(config, facts, problems)
    _check_actor(config, problems)
    _check_critic(config, problems)
    _check_sequence_parallel(config, problems)
    _check_rollout(config, problems)
    _check_algorithm(config, problems)
    _check_data(config, facts, check_files, problems)
    _check_reward(config, check_files, problems)
    problems += tool_problems(config.rollout.multi_turn, check_files)
    _check_trainer(config, check_files, problems)
    _check_profile(config, check_files, problems)
    _check_seeds(config, problems)
    problems += batch_problems(config)
    problems += placement_problems(config, config.trainer.device)
    if facts is not None:
        _check_layout_against_model(config, facts, problems)
    return problems


def _uncached_hub_ids(config: Config) -> dict[str, str]:
    """The hub ids of `config` (by key) that are not in the local HF cache."""
    return {key: repo_id for key, repo_id in hub_values(config).items() if cached_snapshot(repo_id) is None}


def _model_facts(config: Config, check_files: bool, problems: list[Problem]) -> ModelFacts | None:
    """The model's shape facts, or None (a problem is added unless file checks are off)."""
    try:
        return load_model_facts(config.model.path)
    except ModelFactsError as error:
        if check_files or not config.model.path:
            problems.append(Problem("model.path", config.model.path, error.why, error.fix))
        return None


def _need_name(problems: list[Problem], key: str, value: str, valid: tuple[str, ...], what: str) -> None:
    _need(problems, value in valid, key, value, f"unknown {what}{non_ascii_note(value)}", f"use one of {', '.join(valid)}")


def _check_model(config: Config, check_files: bool, problems: list[Problem]) -> None:
    model = config.model
    _need(problems, not model.trust_remote_code, "model.trust_remote_code", True,
          "megarl builds models from config.json and never runs code shipped with a checkpoint",
          "set model.trust_remote_code=false and use a supported architecture")
    _need(problems, not (model.transformer_impl == "transformer_engine" and config.trainer.device == "cpu"),
          "model.transformer_impl", model.transformer_impl, "Transformer Engine is CUDA-only and trainer.device is cpu",
          "use transformer_impl auto or local on CPU")
    _need(problems, not (model.transformer_impl == "transformer_engine" and model.dtype == "float32"),
          "model.transformer_impl", model.transformer_impl,
          "Transformer Engine has no float32 attention for the THD micro-batches its spec takes (model.dtype is float32)",
          "use model.dtype: bfloat16, or model.transformer_impl: auto (the local spec in float32)")
    for role in ("actor", "critic"):
        _need(problems, not (getattr(config, role).offload.optimizer and model.dtype == "float32"),
              f"{role}.offload.optimizer", True,
              "megatron's optimizer offload moves the optimizer's parameters, which with float32 parameters are "
              "the model's own (inside DDP's buffer); only bfloat16 training has a separate fp32 copy to offload",
              f"use model.dtype: bfloat16, or set {role}.offload.optimizer: false")
        _need(problems, not (getattr(config, role).offload.params and not getattr(config, role).optim.use_distributed_optimizer),
              f"{role}.offload.params", True,
              "megatron keeps the parameters in DDP's contiguous buffer (what the offload moves) only with the "
              "distributed optimizer: without it nothing would leave the GPU",
              f"set {role}.optim.use_distributed_optimizer: true, or {role}.offload.params: false")
    tokenizer = model.tokenizer_path
    if check_files and tokenizer is not None and not os.path.isdir(local_path(tokenizer)) and not is_hub_id(tokenizer):
        why = ("is a file, not a directory" if os.path.isfile(local_path(tokenizer))
               else unusable_path(tokenizer) or "directory does not exist")
        problems.append(Problem("model.tokenizer_path", tokenizer, why,
                                "point it at a tokenizer directory, or remove it to use model.path"))


def _check_causal_lm(config: Config, facts: ModelFacts, problems: list[Problem]) -> None:
    """model.path is a causal LM: a `*ForSequenceClassification` checkpoint of the same model type (a reward
    model) has the same shape facts but a score head instead of the LM head the policy samples from."""
    if not facts.source.endswith("config.json"):
        return  # the known-models table lists causal LMs only
    architectures = load_hf_config(facts.source).get("architectures") or []
    architectures = [architectures] if isinstance(architectures, str) else architectures
    others = [name for name in architectures if not (isinstance(name, str) and name.endswith("ForCausalLM"))]
    _need(problems, not others, "model.path", config.model.path,
          f"{facts.source} describes {others}, not a causal LM (*ForCausalLM): the policy generates with the LM head",
          "point model.path at the causal LM checkpoint (a *ForSequenceClassification one is a reward model: set "
          "it as reward.reward_model)")


def _check_tokenizer(config: Config, facts: ModelFacts | None, problems: list[Problem]) -> None:
    """The tokenizer the trainer will load (model.tokenizer_path, else model.path) holds a vocabulary that fits
    the model, and a chat template when data.chat_template is true. A missing directory or uncached hub id is
    reported by its own check."""
    key = "model.tokenizer_path" if config.model.tokenizer_path else "model.path"
    value = config.model.tokenizer_path or config.model.path
    if key == "model.path" and facts is None:
        return  # model.path is no usable checkpoint: its own problem says why
    directory = cached_snapshot(value) if is_hub_id(value) else local_path(value)
    if directory is not None and os.path.isdir(directory):
        problems += tokenizer_problems(key, value, directory, facts)
        if config.data.chat_template is True:
            problem = chat_template_problem(key, value, directory)
            if problem is not None:
                problems.append(problem)


def _check_recompute(prefix: str, recompute: RecomputeConfig, problems: list[Problem]) -> None:
    if recompute.granularity == "full":
        _need(problems, recompute.num_layers is not None and recompute.num_layers >= 1, f"{prefix}.num_layers",
              recompute.num_layers, "full recomputation needs the number of layers per recomputed chunk",
              "set it to 1 or more")
    else:
        _need(problems, recompute.num_layers is None, f"{prefix}.num_layers", recompute.num_layers,
              f"only used with granularity full (granularity is {recompute.granularity})",
              "remove it, or set granularity: full")


def _check_actor(config: Config, problems: list[Problem]) -> None:
    actor = config.actor
    check_optimizer("actor.optim", actor.optim, problems)
    check_cpu_offload("actor.optim", actor.optim, config.model.dtype, problems, actor.offload.optimizer)
    _check_recompute("actor.recompute", actor.recompute, problems)
    _need_name(problems, "actor.policy_loss", actor.policy_loss, names.policy_losses(), "policy loss")
    _need_name(problems, "actor.loss_agg_mode", actor.loss_agg_mode, names.loss_agg_modes(), "loss aggregation")
    _need_name(problems, "actor.kl_loss_type", actor.kl_loss_type, names.kl_estimators(), "KL estimator")
    _need(problems, 0 < actor.clip_ratio_low < 1, "actor.clip_ratio_low", actor.clip_ratio_low,
          "must lie in (0, 1): the ratio is clipped at 1 - clip_ratio_low", "e.g. 0.2")
    _need(problems, actor.clip_ratio_high > 0, "actor.clip_ratio_high", actor.clip_ratio_high,
          "must be > 0: the ratio is clipped at 1 + clip_ratio_high", "e.g. 0.2 (DAPO clip-higher: 0.28)")
    _need(problems, actor.clip_ratio_c > 1, "actor.clip_ratio_c", actor.clip_ratio_c,
          "the dual-clip bound must be > 1", "e.g. 3.0")
    _need(problems, actor.entropy_coeff >= 0, "actor.entropy_coeff", actor.entropy_coeff, "must be >= 0", "e.g. 0")
    _need(problems, actor.kl_loss_coef >= 0, "actor.kl_loss_coef", actor.kl_loss_coef, "must be >= 0", "e.g. 0.001")
    _check_rollout_correction(actor.rollout_correction, problems)
    _check_expert_sync(actor.parallel, problems)
    moe = actor.moe
    _need(problems, moe.aux_loss_coeff is None or moe.aux_loss_coeff >= 0, "actor.moe.aux_loss_coeff",
          moe.aux_loss_coeff, "must be >= 0 (0 turns the load-balancing loss off)",
          "e.g. 0.001, or null for the checkpoint's router_aux_loss_coef")
    _need(problems, moe.z_loss_coeff is None or moe.z_loss_coeff > 0, "actor.moe.z_loss_coeff", moe.z_loss_coeff,
          "must be > 0", "e.g. 0.001, or null for no z-loss")


def _check_expert_sync(parallel: ParallelConfig, problems: list[Problem]) -> None:
    """The weight sync (`megarl.bridge`) plans over the actor's TP × PP: with experts split over EP or
    expert-TP ranks it would look for every expert on every rank, so an RL run refuses those layouts."""
    why = ("the weight sync to the rollout engines does not send experts split over expert-parallel or expert-TP "
           "ranks yet (issue 29 item 3); the experts load, train, checkpoint and export at this layout (megarl sft, "
           "megarl convert)")
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    _need(problems, ep <= 1, "actor.parallel.expert_model_parallel_size", ep, why,
          "set actor.parallel.expert_model_parallel_size: 1 for an RL run")
    _need(problems, etp in (None, parallel.tensor_model_parallel_size), "actor.parallel.expert_tensor_parallel_size",
          etp, why, "leave actor.parallel.expert_tensor_parallel_size unset (the actor's TP) for an RL run")


def _check_rollout_correction(correction: RolloutCorrectionConfig, problems: list[Problem]) -> None:
    key = "actor.rollout_correction"
    if correction.level == "none":
        unused = [name for name in ("mode", "low", "high")
                  if getattr(correction, name) != getattr(RolloutCorrectionConfig, name)]
        for name in unused:
            _need(problems, False, f"{key}.{name}", getattr(correction, name), "no correction is applied (level: none)",
                  f"remove it, or set {key}.level to token, sequence or geometric")
        return
    _need(problems, correction.high >= 1, f"{key}.high", correction.high,
          "must be >= 1: an on-policy token (ratio 1) must keep its weight 1", "e.g. 2.0")
    if correction.mode == "truncate":
        _need(problems, correction.low == 0, f"{key}.low", correction.low,
              "truncation caps ratios from above only", f"remove it, or set {key}.mode: mask to mask low ratios")
    else:
        _need(problems, 0 <= correction.low <= 1, f"{key}.low", correction.low,
              "must lie in [0, 1]: an on-policy token (ratio 1) must be kept", "e.g. 0.5, or 0 for no lower bound")


def _check_critic(config: Config, problems: list[Problem]) -> None:
    critic, estimator = config.critic, config.algorithm.adv_estimator
    if estimator in names.CRITIC_ESTIMATORS:
        _need(problems, critic.enable, "critic.enable", critic.enable, f"adv_estimator {estimator} needs a critic",
              "set critic.enable=true, or use a critic-free estimator such as grpo")
    else:
        _need(problems, not critic.enable, "critic.enable", critic.enable,
              f"adv_estimator {estimator} is critic-free, so the critic would be trained and never used",
              "set critic.enable=false, or algorithm.adv_estimator=gae")
    if not critic.enable:
        return
    check_optimizer("critic.optim", critic.optim, problems)
    check_cpu_offload("critic.optim", critic.optim, config.model.dtype, problems, critic.offload.optimizer)
    _check_recompute("critic.recompute", critic.recompute, problems)
    _need_name(problems, "critic.loss_agg_mode", critic.loss_agg_mode, names.loss_agg_modes(), "loss aggregation")
    _need(problems, critic.cliprange_value > 0, "critic.cliprange_value", critic.cliprange_value, "must be > 0", "e.g. 0.5")
    _need(problems, critic.warmup_steps >= 0, "critic.warmup_steps", critic.warmup_steps, "must be >= 0", "e.g. 0")


def _check_sequence_parallel(config: Config, problems: list[Problem]) -> None:
    """Each Megatron role that runs: the actor, the critic when enabled, the reference when a KL term reads it."""
    roles = {"actor": config.actor.parallel}
    if config.critic.enable:
        roles["critic"] = config.critic.parallel
    if uses_reference(config):
        roles["ref"] = config.ref.parallel
    for role, parallel in roles.items():
        check_sequence_parallel(f"{role}.", parallel, problems)


def _check_rollout(config: Config, problems: list[Problem]) -> None:
    rollout, sync = config.rollout, config.rollout.sync
    _need(problems, rollout.temperature > 0, "rollout.temperature", rollout.temperature,
          "training rollouts must sample (temperature 0 is greedy: every sample of a prompt would be the same)",
          "e.g. 1.0")
    _need(problems, 0 < rollout.top_p <= 1, "rollout.top_p", rollout.top_p, "must lie in (0, 1]", "e.g. 1.0")
    _need(problems, rollout.top_k == -1 or rollout.top_k >= 1, "rollout.top_k", rollout.top_k,
          "must be -1 (off) or >= 1", "e.g. -1")
    _need(problems, rollout.max_new_tokens >= 1, "rollout.max_new_tokens", rollout.max_new_tokens,
          "must be >= 1", "e.g. 512")
    _need(problems, 0 <= rollout.min_new_tokens <= rollout.max_new_tokens, "rollout.min_new_tokens",
          rollout.min_new_tokens, f"must lie in [0, rollout.max_new_tokens = {rollout.max_new_tokens}]",
          f"choose 0 to {rollout.max_new_tokens}")
    _need(problems, all(s != "" and not (isinstance(s, int) and s < 0) for s in rollout.stop), "rollout.stop",
          list(rollout.stop), "stop strings must be non-empty and token ids >= 0", "remove the empty or negative entries")
    _need(problems, 0 < rollout.kv_cache_gib <= MAX_KV_CACHE_GIB, "rollout.kv_cache_gib", rollout.kv_cache_gib,
          f"must lie in (0, {MAX_KV_CACHE_GIB}] GiB (more than a PiB is no machine's memory)", "e.g. 4")
    _need(problems, 0 < rollout.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
          rollout.gpu_memory_utilization, "must lie in (0, 1]", "e.g. 0.5")
    _need(problems, rollout.sleep_level in (1, 2), "rollout.sleep_level", rollout.sleep_level,
          "vLLM's sleep levels that free the weights are 1 (kept in host memory) and 2 (dropped)",
          "use 2 (the weight sync refills the weights) or 1")
    _need(problems, rollout.val_n >= 1, "rollout.val_n", rollout.val_n, "must be >= 1", "e.g. 1")
    _need(problems, rollout.val_temperature >= 0, "rollout.val_temperature", rollout.val_temperature,
          "must be >= 0 (0 is greedy)", "e.g. 0")
    _need(problems, not (rollout.val_n > 1 and rollout.val_temperature == 0), "rollout.val_n", rollout.val_n,
          "greedy validation (val_temperature 0) gives val_n identical samples", "set val_n=1 or val_temperature > 0")
    _need(problems, 0 < rollout.val_top_p <= 1, "rollout.val_top_p", rollout.val_top_p, "must lie in (0, 1]", "e.g. 1.0")
    _need(problems, not (rollout.backend == "hf" and rollout.tensor_model_parallel_size > 1),
          "rollout.tensor_model_parallel_size", rollout.tensor_model_parallel_size,
          "the hf backend (HF generate) has no tensor parallelism", "set it to 1, or rollout.backend=vllm")
    _need(problems, not (rollout.dtype == "float32" and config.model.dtype == "bfloat16"), "rollout.dtype",
          rollout.dtype, "beside model.dtype=bfloat16 the engines would hold bf16 weights in twice the memory, "
          "no more precise", "use auto (the model's dtype) or bfloat16")
    _need(problems, sync.bucket_mb >= 1, "rollout.sync.bucket_mb", sync.bucket_mb, "must be >= 1", "e.g. 512")
    _need(problems, sync.logprob_gap_threshold == "auto" or sync.logprob_gap_threshold > 0,
          "rollout.sync.logprob_gap_threshold", sync.logprob_gap_threshold, "must be > 0 or auto",
          "auto (measured per model and rollout dtype) or e.g. 0.05")
    _need(problems, sync.verify_every >= 1, "rollout.sync.verify_every", sync.verify_every,
          "must be >= 1 (the log-prob check runs every this many steps)", "e.g. 1 to check every sync")
    _need(problems, sync.probe_batch_size >= 1, "rollout.sync.probe_batch_size", sync.probe_batch_size,
          "must be >= 1", "e.g. 4")
    if sync.per_rank == "always":
        train_tp = config.actor.parallel.tensor_model_parallel_size
        _need(problems, sync.transport != "collective", "rollout.sync.per_rank", "always",
              "the per-rank sync streams through shared memory, but rollout.sync.transport is collective",
              "set rollout.sync.transport: auto (or shared_memory), or per_rank: auto")
        _need(problems, train_tp == rollout.tensor_model_parallel_size, "rollout.sync.per_rank", "always",
              f"needs actor TP == rollout TP, got actor TP {train_tp} and rollout TP {rollout.tensor_model_parallel_size}",
              "make the two TP sizes equal, or set rollout.sync.per_rank: auto")
        _need(problems, rollout.backend == "vllm", "rollout.sync.per_rank", "always",
              f"the per-rank load is vLLM's; rollout.backend is {rollout.backend}", "set rollout.sync.per_rank: auto")


MAX_KV_CACHE_GIB = 2**20
"""The largest `rollout.kv_cache_gib` (a PiB, more than any machine's memory): the memory estimate counts
the cache in whole bytes, which a float such as 1e308 GiB overflows."""


def _check_algorithm(config: Config, problems: list[Problem]) -> None:
    algorithm, n = config.algorithm, config.rollout.n
    _need_name(problems, "algorithm.adv_estimator", algorithm.adv_estimator, names.advantage_estimators(),
               "advantage estimator")
    _need_name(problems, "algorithm.kl_penalty", algorithm.kl_penalty, names.kl_estimators(), "KL estimator")
    _need(problems, 0 <= algorithm.gamma <= 1, "algorithm.gamma", algorithm.gamma, "must lie in [0, 1]", "e.g. 1.0")
    _need(problems, 0 <= algorithm.lam <= 1, "algorithm.lam", algorithm.lam, "must lie in [0, 1]", "e.g. 0.95")
    if algorithm.adv_estimator in names.GROUP_ESTIMATORS:
        _need(problems, n >= 2, "rollout.n", n,
              f"{algorithm.adv_estimator} compares the samples of a prompt with each other, so it needs at least 2",
              "set rollout.n to 2 or more (e.g. 8)")
    _need(problems, not (algorithm.adv_estimator == "remax" and config.reward.reward_model), "reward.reward_model",
          config.reward.reward_model, "remax's greedy baseline is scored by reward.function only, so a reward model's "
          "score would be in the samples' rewards but not in the baseline", "remove reward.reward_model, or use "
          "another estimator (e.g. grpo)")
    kl_ctrl = algorithm.kl_ctrl
    _need(problems, kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", kl_ctrl.kl_coef, "must be >= 0", "e.g. 0.001")
    _need(problems, kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl", kl_ctrl.target_kl, "must be > 0", "e.g. 0.1")
    _need(problems, kl_ctrl.horizon >= 1, "algorithm.kl_ctrl.horizon", kl_ctrl.horizon, "must be >= 1", "e.g. 10000")
    sampling = algorithm.dynamic_sampling
    _need(problems, sampling.max_rounds >= 1, "algorithm.dynamic_sampling.max_rounds", sampling.max_rounds,
          "must be >= 1", "e.g. 10")
    if sampling.enable:
        _need(problems, n >= 2, "algorithm.dynamic_sampling.enable", True,
              f"dynamic sampling drops prompts whose samples all score the same; with rollout.n = {n} every prompt "
              "would be dropped", "set rollout.n to 2 or more, or disable dynamic sampling")
    overlong = algorithm.overlong
    if overlong.enable:
        _need(problems, 1 <= overlong.buffer_length < config.rollout.max_new_tokens, "algorithm.overlong.buffer_length",
              overlong.buffer_length, f"the penalty ramp must fit inside the response budget "
                                      f"(rollout.max_new_tokens = {config.rollout.max_new_tokens})",
              f"choose 1 to {config.rollout.max_new_tokens - 1} tokens")
        _need(problems, overlong.penalty_factor >= 0, "algorithm.overlong.penalty_factor", overlong.penalty_factor,
              "must be >= 0", "e.g. 1.0")
    rollout = config.rollout
    _need(problems, not (overlong.filter_truncated and not rollout.multi_turn.enable
                         and rollout.min_new_tokens >= rollout.max_new_tokens >= 1),
          "algorithm.overlong.filter_truncated", True,
          f"rollout.min_new_tokens = rollout.max_new_tokens = {rollout.max_new_tokens}: no stop token can come before "
          "the limit, so every response is cut there and every sample would leave the actor's loss",
          "lower rollout.min_new_tokens, or set algorithm.overlong.filter_truncated: false")


def _check_data(config: Config, facts: ModelFacts | None, check_files: bool, problems: list[Problem]) -> None:
    data = config.data
    _need(problems, len(data.train_files) > 0, "data.train_files", list(data.train_files), "no training data",
          "list the training files, e.g. data.train_files=[train.jsonl]")
    problems += data_file_problems("data.train_files", data.train_files, check_files)
    problems += data_file_problems("data.val_files", data.val_files, check_files)
    _need(problems, data.prompt_key != "", "data.prompt_key", data.prompt_key, "must name a column", "e.g. prompt")
    _need(problems, data.answer_key != "", "data.answer_key", data.answer_key, "must name a column", "e.g. answer")
    _need(problems, data.prompt_key != data.answer_key, "data.prompt_key", data.prompt_key,
          "is also data.answer_key, so the reward function would be handed each prompt as its reference answer",
          "name the prompt column in data.prompt_key and the answer column in data.answer_key")
    _need(problems, data.chat_template != "", "data.chat_template", data.chat_template,
          "an empty template renders nothing", "use true (the tokenizer's template), false, or a Jinja template")
    _need(problems, data.max_prompt_length >= 1, "data.max_prompt_length", data.max_prompt_length,
          "must be >= 1", "e.g. 512")
    _need(problems, data.val_batch_size is None or data.val_batch_size >= 1, "data.val_batch_size", data.val_batch_size,
          "must be >= 1", "e.g. 256, or null for the whole validation set")
    if facts is not None:
        width = response_length(config.rollout)
        key = "rollout.multi_turn.max_total_tokens" if config.rollout.multi_turn.enable else "rollout.max_new_tokens"
        total = data.max_prompt_length + width
        _need(problems, total <= facts.max_position_embeddings, key, width,
              f"data.max_prompt_length {data.max_prompt_length} + {key.rsplit('.', 1)[-1]} {width} = "
              f"{total} tokens exceed the model's max_position_embeddings {facts.max_position_embeddings}",
              f"keep prompt + response within {facts.max_position_embeddings} tokens")


def _check_reward(config: Config, check_files: bool, problems: list[Problem]) -> None:
    reward = config.reward
    if ":" in reward.function:
        problem = reward_function_problem("reward.function", reward.function)
        if problem is not None:
            problems.append(problem)
    else:
        _need(problems, reward.function in names.BUILTIN_REWARDS, "reward.function", reward.function,
              f"neither a built-in reward nor `pkg.module:function`{non_ascii_note(reward.function)}",
              f"use one of {', '.join(names.BUILTIN_REWARDS)} or a function path like my_pkg.rewards:score")
    _need(problems, reward.timeout_s > 0, "reward.timeout_s", reward.timeout_s, "must be > 0 seconds", "e.g. 10")
    _need(problems, 0 < reward.max_failed_fraction <= 1, "reward.max_failed_fraction", reward.max_failed_fraction,
          "must lie in (0, 1] (1: never stop for a failing function)", "e.g. 0.5")
    _need(problems, reward.failure_window >= 1, "reward.failure_window", reward.failure_window,
          "must be >= 1 training step", "e.g. 10")
    if check_files and reward.reward_model is not None and not is_hub_id(reward.reward_model):  # hub ids: above
        _need(problems, os.path.isfile(local_path(reward.reward_model) / "config.json"), "reward.reward_model",
              reward.reward_model, unusable_path(reward.reward_model) or "not an HF checkpoint directory (no config.json)",
              "point it at a reward model directory")


def _check_trainer(config: Config, check_files: bool, problems: list[Problem]) -> None:
    trainer, checkpoint = config.trainer, config.checkpoint
    _need(problems, trainer.total_epochs >= 1, "trainer.total_epochs", trainer.total_epochs, "must be >= 1", "e.g. 1")
    _need(problems, trainer.total_steps is None or trainer.total_steps >= 1, "trainer.total_steps", trainer.total_steps,
          "must be >= 1", "e.g. 100, or null to run all epochs")
    _need(problems, trainer.test_freq >= 0, "trainer.test_freq", trainer.test_freq, "must be >= 0 (0 disables)", "e.g. 10")
    _need(problems, trainer.test_freq == 0 or len(config.data.val_files) > 0, "trainer.test_freq", trainer.test_freq,
          "validation is requested but data.val_files is empty", "list data.val_files, or set trainer.test_freq=0")
    _need(problems, trainer.max_bad_steps >= 1, "trainer.max_bad_steps", trainer.max_bad_steps, "must be >= 1", "e.g. 3")
    _need(problems, trainer.hang_timeout_s >= MIN_HANG_TIMEOUT_S, "trainer.hang_timeout_s", trainer.hang_timeout_s,
          f"must be >= {MIN_HANG_TIMEOUT_S:g} seconds (a worker beats once a second; a shorter limit takes a busy "
          "machine's delay for a stopped process)", "e.g. 600")
    _need(problems, trainer.rollout_mode == "sync" or config.placement.mode == "split", "trainer.rollout_mode",
          trainer.rollout_mode, "generating the next step's batch while the actor trains needs the rollout engines on "
          "devices of their own, but placement.mode is colocated (the engines and the actor take turns on the same "
          "devices)", "set placement.mode: split with placement.rollout_gpus for the engines, or trainer.rollout_mode: sync")
    _need(problems, trainer.peak_flops is None or trainer.peak_flops > 0, "trainer.peak_flops", trainer.peak_flops,
          "must be > 0", "e.g. 989e12 per H100 in bf16 times the actor's GPUs, or null to measure it")
    _need(problems, _is_plain_name(trainer.experiment_name), "trainer.experiment_name", trainer.experiment_name,
          "names the run's directory inside trainer.output_dir, so it must not be empty, '.', '..', or hold a path "
          "separator (the run directory would land outside trainer.output_dir)",
          "use a plain name such as gsm8k-grpo-run1; choose the parent with trainer.output_dir")
    _need(problems, len(set(trainer.loggers)) == len(trainer.loggers), "trainer.loggers", list(trainer.loggers),
          "a logger is listed twice", "list each logger once")
    _need(problems, checkpoint.save_freq >= 0, "checkpoint.save_freq", checkpoint.save_freq,
          "must be >= 0 (0 saves only at the end)", "e.g. 50")
    _need(problems, checkpoint.max_keep is None or checkpoint.max_keep >= 1, "checkpoint.max_keep", checkpoint.max_keep,
          "must be >= 1", "e.g. 3, or null to keep all")
    if not check_files:
        return
    for key, directory in (("checkpoint.dir", checkpoint.dir), ("trainer.output_dir", trainer.output_dir)):
        problem = writable_dir_problem(key, directory)
        if problem is not None:
            problems.append(problem)
    if checkpoint.resume not in ("auto", "disable"):
        problem = _resume_problem(checkpoint.resume)
        if problem is not None:
            problems.append(problem)


def _check_profile(config: Config, check_files: bool, problems: list[Problem]) -> None:
    profile = config.trainer.profile
    steps, ranks = list(profile.steps), profile.ranks
    _need(problems, all(step >= 1 for step in steps) and len(set(steps)) == len(steps), "trainer.profile.steps",
          steps, "steps count from 1 and are listed once each", "e.g. [3, 4]: a few steps after the first (warm-up)")
    if ranks != "all":
        _need(problems, len(ranks) > 0, "trainer.profile.ranks", [], "no rank would record the profiled steps",
              "e.g. [0], or all")
        _need(problems, all(rank >= 0 for rank in ranks) and len(set(ranks)) == len(ranks), "trainer.profile.ranks",
              list(ranks), "ranks count from 0 and are listed once each", "e.g. [0], or all")
        try:
            train_gpus = plan_batches(config).train_gpus  # each Megatron group spans the training devices
        except ConfigError:  # batch_problems reports why
            train_gpus = None
        _need(problems, train_gpus is None or all(rank < train_gpus for rank in ranks), "trainer.profile.ranks",
              list(ranks), f"the Megatron groups have ranks 0 .. {(train_gpus or 1) - 1} ({train_gpus} training devices)",
              f"list ranks below {train_gpus}, or all")
    if check_files and profile.dir:
        problem = writable_dir_problem("trainer.profile.dir", profile.dir)
        if problem is not None:
            problems.append(problem)


def _is_plain_name(name: str) -> bool:
    """A single directory name: `output_dir / name` stays inside output_dir."""
    return name not in ("", ".", "..") and not any(sep in name for sep in ("/", "\\", "\0"))


def _resume_problem(resume: str) -> Problem | None:
    """A `checkpoint.resume` path that is not a complete checkpoint, found now rather than after Ray and
    the engines started (the manifest check is the one `megarl train` runs on resume)."""
    path = local_path(resume)
    if not os.path.isdir(path):
        why = unusable_path(resume) or "neither auto, disable nor an existing checkpoint directory"
        return Problem("checkpoint.resume", resume, why,
                       "use auto (newest in checkpoint.dir), disable, or the path of a saved checkpoint")
    try:
        read_manifest(path)
    except CheckpointError as error:
        if any(_is_checkpoint(child) for child in path.iterdir() if STEP_DIR.match(child.name)):
            fix = f"point it at one of its step_<N> directories, or set checkpoint.dir={resume} and checkpoint.resume=auto"
            return Problem("checkpoint.resume", resume, "a directory of checkpoints, not a checkpoint", fix)
        return Problem("checkpoint.resume", resume, f"not a checkpoint: {error}",
                       "use auto, disable, or a step_<N> directory that megarl saved")
    return None


def _is_checkpoint(path: Path) -> bool:
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


# Offsets are added to a seed per pipeline stage, TP rank and step (megarl.parallel.seed,
# megarl.trainer.settings.step_seed); torch takes seeds below 2**64, so half that range is left for them.
MAX_SEED = 2**63 - 1


def _check_seeds(config: Config, problems: list[Problem]) -> None:
    for key, seed in (("trainer.seed", config.trainer.seed), ("data.seed", config.data.seed),
                      ("rollout.seed", config.rollout.seed)):
        _need(problems, 0 <= seed <= MAX_SEED, key, seed, f"a seed must lie in [0, 2**63 - 1 = {MAX_SEED}]",
              "e.g. 0 or 1234")


def _check_layout_against_model(config: Config, facts: ModelFacts, problems: list[Problem]) -> None:
    """Megatron needs TP | heads, TP | KV groups, TP | MLP width and PP | layers; vLLM needs TP | heads, TP | MLP
    width and TP, KV heads nested."""
    roles = {"actor": (config.actor.parallel, config.actor.recompute)}
    if config.critic.enable:
        roles["critic"] = (config.critic.parallel, config.critic.recompute)
    if uses_reference(config):
        roles["ref"] = (config.ref.parallel, None)
    model = f"the model ({facts.source})"
    for role, (parallel, recompute) in roles.items():
        check_megatron_layout(role, parallel, recompute, facts, model, problems, trained=role != "ref")
    if not facts.num_experts:
        for key, value in (("actor.moe.aux_loss_coeff", config.actor.moe.aux_loss_coeff),
                           ("actor.moe.z_loss_coeff", config.actor.moe.z_loss_coeff)):
            _need(problems, value is None, key, value, f"{model} is dense (model_type {facts.model_type!r}, no experts): "
                  "there is no router to balance", f"remove {key} (null)")
    beyond = [stop for stop in config.rollout.stop if isinstance(stop, int) and stop >= facts.vocab_size]
    _need(problems, not beyond, "rollout.stop", list(config.rollout.stop),
          f"token id(s) {beyond} lie beyond the vocabulary of {model}, ids 0 to {facts.vocab_size - 1}, so they "
          "could never be generated and never stop a response", "list token ids below the vocabulary size, or the "
          "stop text as a string")
    tp, heads, kv = config.rollout.tensor_model_parallel_size, facts.num_attention_heads, facts.num_key_value_heads
    ffn, key = facts.ffn_hidden_size, "rollout.tensor_model_parallel_size"
    if tp >= 1:
        _need(problems, heads % tp == 0, key, tp, f"rollout TP {tp} does not divide the {heads} attention heads of {model}",
              f"use a rollout TP dividing {heads}")
        _need(problems, kv % tp == 0 or tp % kv == 0, key, tp,
              f"vLLM needs rollout TP {tp} and the {kv} KV heads of {model} to divide one another",
              f"use a rollout TP that divides {kv} or is a multiple of it")
        _need(problems, ffn % tp == 0, key, tp, _ffn_split("rollout TP", tp, ffn, model), f"use a rollout TP dividing {ffn}")
        expert = facts.moe_ffn_hidden_size
        _need(problems, expert % tp == 0, key, tp,
              f"vLLM cuts every expert over the rollout TP ranks, and rollout TP {tp} does not divide the expert "
              f"intermediate size {expert} (moe_intermediate_size) of {model}", f"use a rollout TP dividing {expert}")


def _ffn_split(what: str, tp: int, ffn: int, model: str) -> str:
    """Why a TP that does not divide the MLP width fails: Megatron and vLLM alike give each TP rank an equal
    slice of the gate/up rows and of the down projection's columns."""
    return (f"{what} {tp} does not divide the MLP intermediate size {ffn} of {model} ({ffn} ÷ {tp} = {ffn / tp:.2f}): "
            "every TP rank holds an equal slice of the MLP")


def check_megatron_layout(role: str, parallel: ParallelConfig, recompute: RecomputeConfig | None, facts: ModelFacts,
                           model: str, problems: list[Problem], trained: bool = True) -> None:
    """TP | heads, TP | KV groups, TP | MLP width, PP | layers (and recomputed layers within a stage) of `role`'s layout; `role`
    "" for a recipe whose `parallel` section is top-level (`megarl sft`)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    prefix = f"{role}." if role else ""
    heads, kv, layers = facts.num_attention_heads, facts.num_key_value_heads, facts.num_hidden_layers
    if tp >= 1:
        key = f"{prefix}parallel.tensor_model_parallel_size"
        _need(problems, heads % tp == 0, key, tp, f"TP {tp} does not divide the {heads} attention heads of {model}",
              f"use a TP dividing {heads}")
        _need(problems, kv % tp == 0, key, tp, f"Megatron needs TP {tp} to divide the {kv} KV groups of {model} "
                                               f"({kv} ÷ {tp} = {kv / tp:.2f})", f"use a TP dividing {kv}")
        ffn = facts.ffn_hidden_size
        _need(problems, ffn % tp == 0, key, tp, _ffn_split("TP", tp, ffn, model), f"use a TP dividing {ffn}")
    _check_expert_layout(prefix, parallel, facts, model, problems, trained)
    if pp >= 1:
        _need(problems, layers % pp == 0, f"{prefix}parallel.pipeline_model_parallel_size", pp,
              f"PP {pp} does not divide the {layers} layers of {model} ({layers} ÷ {pp} = {layers / pp:.2f})",
              f"use a PP dividing {layers}")
        if recompute is not None and recompute.num_layers is not None and layers % pp == 0 and recompute.num_layers >= 1:
            per_stage = layers // pp
            _need(problems, recompute.num_layers <= per_stage, f"{prefix}recompute.num_layers", recompute.num_layers,
                  f"more than the {per_stage} layers of a pipeline stage ({layers} layers ÷ PP {pp})",
                  f"use 1 to {per_stage}")


def _check_expert_layout(prefix: str, parallel: ParallelConfig, facts: ModelFacts, model: str,
                         problems: list[Problem], trained: bool) -> None:
    """EP | experts and expert TP | expert width for a mixture-of-experts model; neither set for a dense one.
    A trained mixture of experts with TP > 1 needs sequence parallelism: without it every TP rank routes
    the same tokens to the experts, whose gradients would count each token TP times (Megatron-LM's
    arguments refuse MoE with TP > 1 and no --sequence-parallel)."""
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    ep_key, etp_key = f"{prefix}parallel.expert_model_parallel_size", f"{prefix}parallel.expert_tensor_parallel_size"
    experts, width = facts.num_experts, facts.moe_ffn_hidden_size
    if not experts:
        dense = f"{model} is dense (model_type {facts.model_type!r}, no experts)"
        _need(problems, ep == 1, ep_key, ep, f"{dense}: expert parallelism splits experts", f"set {ep_key}: 1")
        _need(problems, etp is None, etp_key, etp, f"{dense}: expert TP cuts experts", f"remove {etp_key} (null)")
        return
    tp = parallel.tensor_model_parallel_size
    sp_key = f"{prefix}parallel.sequence_parallel"
    _need(problems, not trained or tp <= 1 or parallel.sequence_parallel, sp_key, False,
          f"{model} is a mixture of experts trained at TP {tp}: without sequence parallelism every TP rank would route "
          "the same tokens to the experts and their gradients would count each token TP times (Megatron-LM refuses "
          "MoE with TP > 1 without --sequence-parallel)", f"set {sp_key}: true")
    if ep >= 1:
        _need(problems, experts % ep == 0, ep_key, ep,
              f"EP {ep} does not divide the {experts} experts of {model} (each EP rank holds an equal share)",
              f"use an EP dividing {experts}")
    etp = parallel.tensor_model_parallel_size if etp is None else etp
    if etp >= 1:
        _need(problems, width % etp == 0, etp_key, etp,
              f"expert TP {etp} does not divide the expert intermediate size {width} (moe_intermediate_size) of {model}",
              f"use an expert TP dividing {width} (unset, it is the role's TP)")
