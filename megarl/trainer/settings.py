"""Config → what the workers take beside the config's own sections: micro-batch cuts, sampling, stop tokens, seeds, optimizer steps."""

from megarl.config.batch_plan import BatchPlan
from megarl.config.config import Config
from megarl.config.problems import ConfigError, Problem
from megarl.config.token_budget import sample_token_bound, token_budget
from megarl.workers.packing import TokenBudget
from megarl.workers.rollout.base import SamplingConfig


def micro_batch_cut(role_config, role: str, config: Config) -> int | TokenBudget:
    """How `role` ("actor", "critic", "ref"; its section `role_config`) cuts a rank's samples: packed
    micro-batches under its token budget (`max_tokens_per_micro_batch`, "auto" resolved by
    `megarl.config.token_budget`), else `micro_batch_size_per_gpu` padded samples."""
    budget = token_budget(role_config, sample_token_bound(config))
    if budget is None:
        return role_config.micro_batch_size_per_gpu
    return TokenBudget(budget, f"{role}.max_tokens_per_micro_batch")


def forward_micro_batch_cut(role_config, role: str, config: Config) -> int | TokenBudget:
    """How trained `role` ("actor", "critic") cuts a rank's samples for its forward-only pass: its own
    budget (`forward_max_tokens_per_micro_batch`), else the update's cut (`micro_batch_cut`)."""
    if role_config.forward_max_tokens_per_micro_batch is None:
        return micro_batch_cut(role_config, role, config)
    return TokenBudget(role_config.forward_max_tokens_per_micro_batch, f"{role}.forward_max_tokens_per_micro_batch")


def stop_token_ids(tokenizer, stop: tuple[str | int, ...]) -> tuple[int, ...]:
    """The token ids that end a response: the tokenizer's EOS and `rollout.stop` (ids as they are,
    strings by their single token); `ConfigError` naming each string that is not one token and each id
    outside the vocabulary."""
    ids, problems = [tokenizer.eos_token_id], []
    for entry in stop:
        tokens = [entry] if isinstance(entry, int) else tokenizer.encode(entry, add_special_tokens=False)
        if len(tokens) != 1:
            problems.append(
                Problem(
                    "rollout.stop",
                    entry,
                    f"the tokenizer encodes it as {len(tokens)} tokens {tokens}; generation stops on single tokens",
                    "give one token (its id or its text)",
                )
            )
        elif not 0 <= tokens[0] < len(tokenizer):
            problems.append(
                Problem(
                    "rollout.stop",
                    entry,
                    f"no such token: the vocabulary has {len(tokenizer)}",
                    f"use an id below {len(tokenizer)}",
                )
            )
        else:
            ids.append(tokens[0])
    if problems:
        raise ConfigError(problems)
    return tuple(dict.fromkeys(ids))


def sampling_config(
    config: Config, stop_token_ids: tuple[int, ...], seed: int, validation: bool = False
) -> SamplingConfig:
    """Training sampling, or validation sampling (`rollout.val_*`; temperature 0 = greedy)."""
    rollout = config.rollout
    if validation:
        return SamplingConfig(
            n=rollout.val_n,
            temperature=rollout.val_temperature or 1.0,
            top_p=rollout.val_top_p,
            max_new_tokens=rollout.max_new_tokens,
            min_new_tokens=rollout.min_new_tokens,
            stop_token_ids=stop_token_ids,
            seed=seed,
            seed_each_sample=rollout.seed_each_sample,
            greedy=rollout.val_temperature == 0,
        )
    return SamplingConfig(
        n=rollout.n,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        min_new_tokens=rollout.min_new_tokens,
        stop_token_ids=stop_token_ids,
        seed=seed,
        seed_each_sample=rollout.seed_each_sample,
    )


def step_seed(config: Config, plan: BatchPlan, step: int) -> int:
    """The sampling seed of training step `step`. A step's samples take the seeds `seed + [0, S)`
    (`megarl.rollout.generate_contexts`: one per sample, prompt-major), S = samples per step × the
    generation rounds a step may run (DAPO's dynamic sampling draws up to `max_rounds` batches) × the
    turns of a sample (the agent loop seeds each turn anew); a stride of S keeps every generation of
    a run on a seed of its own."""
    sampling = config.algorithm.dynamic_sampling
    rounds = sampling.max_rounds if sampling.enable else 1
    multi_turn = config.rollout.multi_turn
    turns = multi_turn.max_turns if multi_turn.enable else 1
    return config.rollout.seed + step * plan.samples_per_step * rounds * turns


def total_optimizer_steps(plan: BatchPlan, role: str, total_steps: int) -> int:
    update = getattr(plan, role).update
    return update.optimizer_steps_per_step * total_steps
