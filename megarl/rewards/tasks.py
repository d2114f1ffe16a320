"""Synthetic tasks small enough for a tiny random-init model on CPU: their data generators and rewards.

`repeat_first_char` (the quickstart): the prompt is a random string of 3 to 6 characters over
`REPEAT_ALPHABET` (`"abcde"`); the answer is the prompt's first character. Reward per response: 1.0 if
it starts with that character, else 0.0 (an empty response too).

Why this shape (measured with a plain GRPO loop on the default tiny Qwen2, 16 prompts x 8 samples,
2 new tokens, one optimizer step per training step, 3 sampling seeds): at lr 1e-3 the exact-match rate
goes from 0.01 (random init, 100-token vocabulary) to 0.24-0.35 by step 40 and 0.62 / 0.93 / 0.98 by
step 100; at lr 3e-3 it peaks near 0.5-0.6 around step 60 and then wobbles between 0.3 and 0.55.
Partial credit for "a letter of the alphabet, but the wrong one" (0.1, even 0.02) made it *worse*:
the policy collapses onto one letter within a few steps, every group then gets identical rewards,
GRPO's advantages vanish and the exact rate sticks at chance (~0.2). So the reward stays binary.
With 8 letters (lr 3e-3) 120 steps reach only ~0.23. Prompts use only characters of the tiny model's
char tokenizer (`megarl.models.tiny.CHARACTERS`).

    megarl make-data --task repeat_first_char --out outputs/quickstart-data   # train.jsonl, val.jsonl

`calc_tool_demos` (the agent warm-up, `megarl sft`): demonstration conversations, not prompts. The user
asks for a sum of two numbers below 100; the assistant calls the `calc` tool (hermes format), the tool
answers, the assistant repeats the result. A random-init model never writes a tool call by chance;
a few of these teach it the format before RL with tools.

    megarl make-data --task calc_tool_demos --out outputs/sft-data   # rows {"messages": [...], "tools": [...]}
"""

from __future__ import annotations

import random
from collections.abc import Callable

REPEAT_ALPHABET = "abcde"
"""Characters of repeat_first_char prompts (and of the answers)."""
REPEAT_LENGTHS = (3, 6)
"""Shortest and longest repeat_first_char prompt, in characters."""


def repeat_first_char(prompts: list[str], responses: list[str], answer: list[str], **columns) -> list[float]:
    """Reward of the quickstart task: 1.0 if the response starts with the expected character, else 0.0."""
    return [1.0 if response[:1] == expected else 0.0 for response, expected in zip(responses, answer)]


def repeat_first_char_rows(count: int, rng: random.Random) -> list[dict[str, str]]:
    """`count` distinct rows `{"prompt": "cbdea", "answer": "c"}`."""
    prompts: dict[str, None] = {}  # insertion-ordered set
    shortest, longest = REPEAT_LENGTHS
    if count > sum(len(REPEAT_ALPHABET) ** length for length in range(shortest, longest + 1)):
        raise ValueError(f"repeat_first_char: cannot make {count} distinct prompts of length {shortest}..{longest} "
                         f"over {len(REPEAT_ALPHABET)} characters")
    while len(prompts) < count:
        length = rng.randint(shortest, longest)
        prompts["".join(rng.choice(REPEAT_ALPHABET) for _ in range(length))] = None
    return [{"prompt": prompt, "answer": prompt[0]} for prompt in prompts]


CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}
"""The OpenAI function schema of calc_tool_demos' tool."""


def calc_tool_demo_rows(count: int, rng: random.Random) -> list[dict]:
    """`count` distinct demonstrations `{"messages": [user, assistant tool call, tool, assistant], "tools": [calc]}`."""
    if count > 100 * 100:
        raise ValueError(f"calc_tool_demos: cannot make {count} distinct sums of two numbers below 100")
    pairs: dict[tuple[int, int], None] = {}  # insertion-ordered set
    while len(pairs) < count:
        pairs[rng.randrange(100), rng.randrange(100)] = None
    rows = []
    for a, b in pairs:
        call = f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{a}+{b}"}}}}</tool_call>'
        messages = [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": call},
                    {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]
        rows.append({"messages": messages, "tools": [CALC_TOOL]})
    return rows


TASKS: dict[str, Callable[[int, random.Random], list[dict]]] = {
    "repeat_first_char": repeat_first_char_rows,
    "calc_tool_demos": calc_tool_demo_rows,
}
"""Synthetic tasks by name: a generator of `count` distinct rows from a seeded RNG (prompt tasks: `prompt`,
`answer`; demonstration tasks: `messages`, `tools`, for `megarl sft`)."""
