"""Exact-match QA reward (`reward.function: qa_em`), as Search-R1 scores open-domain QA: the text of the
response's *last* `<answer>...</answer>` must equal one of the reference answers after SQuAD's
normalisation (lower case, punctuation and the articles a/an/the removed, whitespace collapsed). No
answer tag scores 0. The reference is a string or a list of accepted strings (NQ, HotpotQA).
"""

from __future__ import annotations

import re
import string

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def qa_em_score(response: str, answer: str | list[str]) -> float:
    """1.0 if the last `<answer>` tag's text matches a reference after normalisation, else 0.0."""
    found = _ANSWER.findall(response)
    if not found:
        return 0.0
    references = [answer] if isinstance(answer, str) else list(answer)
    predicted = normalize_answer(found[-1])
    return 1.0 if any(predicted == normalize_answer(str(r)) for r in references) else 0.0


def qa_em_reward(prompts: list[str], responses: list[str], answer: list, **columns) -> list[float]:
    """Reward-function form: one score per response (multi-turn: the response is the last turn)."""
    return [qa_em_score(response, reference) for response, reference in zip(responses, answer)]
