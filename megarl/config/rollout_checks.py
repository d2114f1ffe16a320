"""The checks of the `rollout` section and of `actor.rollout_correction` (`megarl.config.validate` runs them):
engine, sampling, sync, KV cache, partial rollouts; each problem names the key, value, reason and fix."""

from megarl.config.config import Config
from megarl.config.engines import ENGINES, engine_capabilities
from megarl.config.problems import Problem
from megarl.config.role_checks import need
from megarl.config.roles import RolloutCorrectionConfig


def check_rollout_correction(correction: RolloutCorrectionConfig, problems: list[Problem]) -> None:
    key = "actor.rollout_correction"
    if correction.level == "none":
        unused = [
            name
            for name in ("mode", "low", "high")
            if getattr(correction, name) != getattr(RolloutCorrectionConfig, name)
        ]
        for name in unused:
            need(
                problems,
                False,
                f"{key}.{name}",
                getattr(correction, name),
                "no correction is applied (level: none)",
                f"remove it, or set {key}.level to token, sequence or geometric",
            )
        return
    need(
        problems,
        correction.high >= 1,
        f"{key}.high",
        correction.high,
        "must be >= 1: an on-policy token (ratio 1) must keep its weight 1",
        "e.g. 2.0",
    )
    if correction.mode == "truncate":
        need(
            problems,
            correction.low == 0,
            f"{key}.low",
            correction.low,
            "truncation caps ratios from above only",
            f"remove it, or set {key}.mode: mask to mask low ratios",
        )
    else:
        need(
            problems,
            0 <= correction.low <= 1,
            f"{key}.low",
            correction.low,
            "must lie in [0, 1]: an on-policy token (ratio 1) must be kept",
            "e.g. 0.5, or 0 for no lower bound",
        )


def _check_over_sampling(config: Config, problems: list[Problem]) -> None:
    rollout, key = config.rollout, "rollout.over_sampling"
    need(problems, rollout.over_sampling >= 0, key, rollout.over_sampling, "must be >= 0", "e.g. 0 (off) or 16")
    if rollout.over_sampling <= 0:
        return
    need(
        problems,
        rollout.partial_rollout > 0,
        key,
        rollout.over_sampling,
        "groups are carried from one step's generation into the next only in partial rollouts (rollout."
        "partial_rollout is 0)",
        "set rollout.partial_rollout (e.g. 32, with trainer.rollout_mode: async), or rollout.over_sampling: 0",
    )
    need(
        problems,
        config.trainer.max_staleness >= 2,
        key,
        rollout.over_sampling,
        f"a carried group is trained at least one step after it started, so the stream keeps one version of "
        f"trainer.max_staleness ({config.trainer.max_staleness}) for it and starts a batch at most max_staleness - 1 "
        "versions stale: at 1 no batch would be generated ahead of the training, and without that room every "
        "carried group would be too stale for the next batch and start over, its tokens thrown away",
        "set trainer.max_staleness: 2 (or more), or rollout.over_sampling: 0",
    )
    need(
        problems,
        rollout.min_new_tokens == 0,
        key,
        rollout.over_sampling,
        f"new groups start in the same segment as carried ones, which must not be held to "
        f"rollout.min_new_tokens ({rollout.min_new_tokens}) again",
        "set rollout.min_new_tokens: 0, or rollout.over_sampling: 0",
    )


def _check_partial_rollout(config: Config, problems: list[Problem]) -> None:
    rollout, key = config.rollout, "rollout.partial_rollout"
    if rollout.partial_rollout == 0:
        return
    need(
        problems,
        rollout.partial_rollout >= max(1, rollout.min_new_tokens),
        key,
        rollout.partial_rollout,
        f"must be 0 (off) or at least 1 and rollout.min_new_tokens ({rollout.min_new_tokens}): a segment after "
        "the first cannot know how many tokens the sample still must make",
        f"e.g. {max(64, rollout.min_new_tokens)}",
    )
    need(
        problems,
        config.trainer.rollout_mode == "async",
        key,
        rollout.partial_rollout,
        f"weight updates land between generations only in trainer.rollout_mode async (it is "
        f"{config.trainer.rollout_mode})",
        "set trainer.rollout_mode: async, or rollout.partial_rollout: 0",
    )


def check_rollout(config: Config, problems: list[Problem]) -> None:
    rollout, sync = config.rollout, config.rollout.sync
    need(
        problems,
        rollout.temperature > 0,
        "rollout.temperature",
        rollout.temperature,
        "training rollouts must sample (temperature 0 is greedy: every sample of a prompt would be the same)",
        "e.g. 1.0",
    )
    need(problems, 0 < rollout.top_p <= 1, "rollout.top_p", rollout.top_p, "must lie in (0, 1]", "e.g. 1.0")
    need(
        problems,
        rollout.top_k == -1 or rollout.top_k >= 1,
        "rollout.top_k",
        rollout.top_k,
        "must be -1 (off) or >= 1",
        "e.g. -1",
    )
    need(
        problems,
        rollout.max_new_tokens >= 1,
        "rollout.max_new_tokens",
        rollout.max_new_tokens,
        "must be >= 1",
        "e.g. 512",
    )
    _check_partial_rollout(config, problems)
    _check_over_sampling(config, problems)
    need(
        problems,
        0 <= rollout.min_new_tokens <= rollout.max_new_tokens,
        "rollout.min_new_tokens",
        rollout.min_new_tokens,
        f"must lie in [0, rollout.max_new_tokens = {rollout.max_new_tokens}]",
        f"choose 0 to {rollout.max_new_tokens}",
    )
    need(
        problems,
        all(s != "" and not (isinstance(s, int) and s < 0) for s in rollout.stop),
        "rollout.stop",
        list(rollout.stop),
        "stop strings must be non-empty and token ids >= 0",
        "remove the empty or negative entries",
    )
    need(
        problems,
        0 < rollout.kv_cache_gib <= MAX_KV_CACHE_GIB,
        "rollout.kv_cache_gib",
        rollout.kv_cache_gib,
        f"must lie in (0, {MAX_KV_CACHE_GIB}] GiB (more than a PiB is no machine's memory)",
        "e.g. 4",
    )
    need(
        problems,
        0 < rollout.gpu_memory_utilization <= 1,
        "rollout.gpu_memory_utilization",
        rollout.gpu_memory_utilization,
        "must lie in (0, 1]",
        "e.g. 0.5",
    )
    need(
        problems,
        rollout.sleep_level in (1, 2),
        "rollout.sleep_level",
        rollout.sleep_level,
        "vLLM's sleep levels that free the weights are 1 (kept in host memory) and 2 (dropped)",
        "use 2 (the weight sync refills the weights) or 1",
    )
    need(problems, rollout.val_n >= 1, "rollout.val_n", rollout.val_n, "must be >= 1", "e.g. 1")
    need(
        problems,
        rollout.val_temperature >= 0,
        "rollout.val_temperature",
        rollout.val_temperature,
        "must be >= 0 (0 is greedy)",
        "e.g. 0",
    )
    need(
        problems,
        not (rollout.val_n > 1 and rollout.val_temperature == 0),
        "rollout.val_n",
        rollout.val_n,
        "greedy validation (val_temperature 0) gives val_n identical samples",
        "set val_n=1 or val_temperature > 0",
    )
    need(problems, 0 < rollout.val_top_p <= 1, "rollout.val_top_p", rollout.val_top_p, "must lie in (0, 1]", "e.g. 1.0")
    need(
        problems,
        (max_tp := engine_capabilities(rollout.backend).max_tensor_parallel) is None
        or rollout.tensor_model_parallel_size <= max_tp,
        "rollout.tensor_model_parallel_size",
        rollout.tensor_model_parallel_size,
        f"the {rollout.backend} backend runs at most TP {max_tp}",
        f"set it to at most {max_tp}, or a rollout.backend with tensor parallelism ({_engines_where('max_tensor_parallel', None)})",
    )
    need(
        problems,
        not (rollout.dtype == "float32" and config.model.dtype == "bfloat16"),
        "rollout.dtype",
        rollout.dtype,
        "beside model.dtype=bfloat16 the engines would hold bf16 weights in twice the memory, no more precise",
        "use auto (the model's dtype) or bfloat16",
    )
    need(problems, sync.bucket_mb >= 1, "rollout.sync.bucket_mb", sync.bucket_mb, "must be >= 1", "e.g. 512")
    need(
        problems,
        sync.logprob_gap_threshold == "auto" or sync.logprob_gap_threshold > 0,
        "rollout.sync.logprob_gap_threshold",
        sync.logprob_gap_threshold,
        "must be > 0 or auto",
        "auto (measured per model and rollout dtype) or e.g. 0.05",
    )
    need(
        problems,
        sync.verify_every >= 1,
        "rollout.sync.verify_every",
        sync.verify_every,
        "must be >= 1 (the log-prob check runs every this many steps)",
        "e.g. 1 to check every sync",
    )
    need(
        problems,
        sync.probe_batch_size >= 1,
        "rollout.sync.probe_batch_size",
        sync.probe_batch_size,
        "must be >= 1",
        "e.g. 4",
    )
    actor_pp = config.actor.parallel.pipeline_model_parallel_size
    need(
        problems,
        config.actor.parallel.virtual_pipeline_model_parallel_size is None or sync.probe_batch_size >= actor_pp,
        "rollout.sync.probe_batch_size",
        sync.probe_batch_size,
        f"the actor's probe pass runs one sequence per micro-batch, and megatron's interleaved schedule (actor."
        f"parallel.virtual_pipeline_model_parallel_size) needs at least PP {actor_pp} micro-batches",
        f"use {actor_pp} or more",
    )
    if sync.per_rank == "always":
        train_tp = config.actor.parallel.tensor_model_parallel_size
        need(
            problems,
            sync.transport != "collective",
            "rollout.sync.per_rank",
            "always",
            "the per-rank sync streams through shared memory, but rollout.sync.transport is collective",
            "set rollout.sync.transport: auto (or shared_memory), or per_rank: auto",
        )
        need(
            problems,
            train_tp == rollout.tensor_model_parallel_size,
            "rollout.sync.per_rank",
            "always",
            f"needs actor TP == rollout TP, got actor TP {train_tp} and rollout TP {rollout.tensor_model_parallel_size}",
            "make the two TP sizes equal, or set rollout.sync.per_rank: auto",
        )
        need(
            problems,
            engine_capabilities(rollout.backend).per_rank_load,
            "rollout.sync.per_rank",
            "always",
            f"rollout.backend {rollout.backend} has no per-rank load (engines with one: {_engines_where('per_rank_load', True)})",
            "set rollout.sync.per_rank: auto",
        )


MAX_KV_CACHE_GIB = 2**20
"""The largest `rollout.kv_cache_gib` (a PiB, more than any machine's memory): the memory estimate counts
the cache in whole bytes, which a float such as 1e308 GiB overflows."""


def _engines_where(capability: str, value) -> str:
    """The backends whose `capability` is `value`, for an error's fix."""
    return ", ".join(name for name, row in ENGINES.items() if getattr(row, capability) == value)
