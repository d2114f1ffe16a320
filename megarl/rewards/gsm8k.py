"""GSM8K rule reward: the response must end its reasoning with `#### <number>`, and the number must equal
the reference answer.

Strict format, as verl's gsm8k scorer: the *last* `#### N` of the response is the answer (commas and a
leading `$` allowed, `#### 1,000`, `#### $18`); a response without one scores 0. Numbers compare by
value (`72`, `72.0` and `72.00` are equal). The reference may be the bare number or the dataset's
full solution text ending in `#### N`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_FINAL_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9.,]+)")


def extract_final_answer(text: str) -> str | None:
    """The number after the last `####` in `text`, commas removed; None when there is none."""
    matches = _FINAL_ANSWER.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "").rstrip(".") or None


def gsm8k_score(response: str, answer: str | int | float) -> float:
    """1.0 if the response's final `#### N` equals the reference number, else 0.0."""
    reference = str(answer)
    if "####" in reference:
        reference = extract_final_answer(reference) or ""
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    value = _number(predicted)
    return 1.0 if value is not None and value == _number(reference.replace(",", "")) else 0.0


def gsm8k_reward(prompts: list[str], responses: list[str], answer: list, **columns) -> list[float]:
    """Reward-function form (`reward.function: gsm8k`): one score per response."""
    return [gsm8k_score(response, reference) for response, reference in zip(responses, answer)]


def _number(text: str) -> Decimal | None:
    try:
        return Decimal(text.strip())
    except InvalidOperation:
        return None
