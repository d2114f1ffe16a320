"""Reward functions by name: the built-in rules, or a user's `pkg.module:function`, and the check of what they return.

A reward function has TRL's signature

    fn(prompts: list[str], responses: list[str], *, answer: list, **columns) -> list[float]

prompts: the prompt texts as the model saw them (chat template applied); responses: the generated
texts, one per sample, same order; answer: the `data.answer_key` column; columns: the dataset's other
columns by name. It returns one finite number per response (a list, or a torch or numpy array), within
float32's range (the trainer holds rewards as float32: a larger one would turn into inf there, and its
advantages into NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from numbers import Real

from megarl.isolation import FunctionNotFound, import_function

BUILTIN_REWARDS = {
    "gsm8k": "megarl.rewards.gsm8k:gsm8k_reward",
    "math": "megarl.rewards.math_answer:math_reward",
    "qa_em": "megarl.rewards.qa_em:qa_em_reward",
    "code": "megarl.rewards.code_tests:code_reward",
}
"""`reward.function` names of the rule rewards shipped with megarl, and the functions they stand for."""

RewardFn = Callable[..., list[float]]

FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32 (`torch.finfo(torch.float32).max`): the bound on a reward's magnitude."""


class RewardFunctionError(RuntimeError):
    """The reward function cannot be used: it does not resolve, or it returned something other than one
    finite float32-sized number per response, or it raised this itself (the `code` reward on test cases
    that do not parse, `run_sandboxed` where nothing may run the code). The message names the function (and
    the value and the response it scored). It stops the run (a bug, not bad luck)."""


def function_path(spec: str) -> str:
    """`pkg.module:function` for a built-in name or a user path (returned as is)."""
    return BUILTIN_REWARDS.get(spec, spec)


def resolve_reward_function(spec: str) -> RewardFn:
    """Import the function named by `spec` (a built-in name or `pkg.module:function`).

    Raises RewardFunctionError naming `spec` when the module does not import, the attribute is
    missing, or it is not callable. This imports (runs) the module: call it where user code may run.
    """
    path = function_path(spec)
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise RewardFunctionError(
            f"reward.function {spec!r}: neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor "
            "a function path `pkg.module:function`; write e.g. my_rewards.tasks:score"
        )
    try:
        return import_function(path)
    except FunctionNotFound as error:
        raise RewardFunctionError(f"reward.function {spec!r}: {error}") from error


def checked_scores(spec: str, result: object, responses: list[str], first: int = 0) -> list[float]:
    """`result` as floats if it is a sequence of one finite real number per response, each within
    float32's range; else RewardFunctionError. `first`: the batch index of `responses[0]`, to name a
    bad score by its place in the batch."""
    kind = type(result).__name__
    if hasattr(result, "tolist"):  # a torch tensor or numpy array: its numbers
        result = result.tolist()
    try:
        if isinstance(result, (str, bytes, Mapping)):  # iterable, but their items are characters or keys
            raise TypeError
        values = list(result)
    except TypeError:
        raise RewardFunctionError(
            f"reward.function {spec!r} returned a {kind} ({repr(result)[:80]}); it must "
            f"return a list of {len(responses)} floats, one per response"
        ) from None
    if len(values) != len(responses):
        raise RewardFunctionError(
            f"reward.function {spec!r} returned {len(values)} scores for {len(responses)} "
            "responses; it must return exactly one score per response"
        )
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, Real) or not abs(value) <= FLOAT32_MAX:
            raise RewardFunctionError(
                f"reward.function {spec!r} returned {value!r} ({type(value).__name__}) as score {first + index}; "
                f"every score must be a finite int or float of magnitude at most {FLOAT32_MAX:.4g} (float32, "
                f"the trainer's reward type); the response it scored: {_excerpt(responses[index])}"
            )
    return [float(value) for value in values]


def _excerpt(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
