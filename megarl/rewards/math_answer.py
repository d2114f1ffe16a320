"""MATH rule reward: the last `\\boxed{...}` of the response, checked against the reference with `math-verify`.

Equivalent forms count (`\\frac{1}{2}` = `0.5`, `x^2+1` = `1+x^2`, `\\sqrt{2}/2` = `\\frac{\\sqrt2}{2}`): both
sides are parsed to sympy and compared by math-verify. A response without a boxed answer scores 0.
The reference may be the bare answer or a full solution containing `\\boxed{...}`.

math-verify's own signal-based time limits are turned off: they only work on a process's main thread,
and the reward runs in an isolated worker process whose call has a time limit anyway.
"""

from __future__ import annotations

from math_verify import parse, verify

from megarl.rewards.boxed import last_boxed


def math_score(response: str, answer: str | int | float) -> float:
    """1.0 if the response's last boxed answer is mathematically equal to the reference, else 0.0."""
    predicted = last_boxed(response)
    if predicted is None:
        return 0.0
    reference = str(answer)
    reference = last_boxed(reference) or reference
    gold = parse(f"${reference}$", parsing_timeout=None)
    target = parse(f"${predicted}$", parsing_timeout=None)
    if not gold or not target:
        # math-verify cannot read one side (plain text answers, e.g. "\\text{Monday}"): compare the strings.
        return 1.0 if _squeezed(predicted) == _squeezed(reference) else 0.0
    return 1.0 if verify(gold, target, timeout_seconds=None) else 0.0


def math_reward(prompts: list[str], responses: list[str], answer: list, **columns) -> list[float]:
    """Reward-function form (`reward.function: math`): one score per response."""
    return [math_score(response, reference) for response, reference in zip(responses, answer)]


def _squeezed(text: str) -> str:
    return "".join(text.split())
