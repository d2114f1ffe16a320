"""The last `\\boxed{...}` of a text: the final answer of a MATH solution or of a response.

Kept apart from the MATH reward (`math_answer`) so that data preparation can read answers without
importing math-verify and sympy.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces allowed) or `\\boxed 5`; None if none."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    if text[start : start + 1] != "{":
        # `\boxed 5`: the answer runs to the next whitespace or `$`.
        return re.match(r"[^\s$]*", text[start:]).group(0) or None
    depth = 0
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start + 1 : index]
    return None  # unbalanced: the text was cut off inside the box
