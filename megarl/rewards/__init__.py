"""Rewards: rule-based (GSM8K, MATH), synthetic tasks, and user functions `pkg.module:function`, scored isolated.

    with RewardScorer.from_config(config.reward) as scorer:
        result = scorer(prompt_texts, responses, **reward_columns(samples))   # RewardResult(scores, metrics)

Kept light on purpose: the worker process imports this package, and importing it must not pull in
math-verify/sympy (the MATH reward) or torch.
"""

from megarl.credentials import SECRET_NAME
from megarl.isolation import worker_environment
from megarl.rewards.functions import (
    BUILTIN_REWARDS,
    RewardFunctionError,
    checked_scores,
    function_path,
    resolve_reward_function,
)
from megarl.rewards.scorer import METRICS, RewardResult, RewardScorer

__all__ = [
    "BUILTIN_REWARDS",
    "METRICS",
    "SECRET_NAME",
    "RewardFunctionError",
    "RewardResult",
    "RewardScorer",
    "checked_scores",
    "function_path",
    "resolve_reward_function",
    "worker_environment",
]
