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
asks for a sum of two two-digit numbers; the assistant calls the built-in `calculator` tool (hermes format), the tool
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
        raise ValueError(
            f"repeat_first_char: cannot make {count} distinct prompts of length {shortest}..{longest} "
            f"over {len(REPEAT_ALPHABET)} characters"
        )
    while len(prompts) < count:
        length = rng.randint(shortest, longest)
        prompts["".join(rng.choice(REPEAT_ALPHABET) for _ in range(length))] = None
    return [{"prompt": prompt, "answer": prompt[0]} for prompt in prompts]


CALC_OPERANDS = range(10, 100)
"""Operands of the calc tasks: two digits each, so a call and its answer sit at the same places in every
conversation (what a tiny model can learn to copy)."""


def calc_answer(prompts: list[str], responses: list[str], answer: list[str], **columns) -> list[float]:
    """Reward of the agent quickstart (`calc`): 1.0 if the final answer is the sum, else 0.0."""
    return [1.0 if response.strip() == expected else 0.0 for response, expected in zip(responses, answer)]


def _for_demos(a: int, b: int) -> bool:
    """Whether the sum a+b belongs to the demonstrations (else to the RL prompts): a fixed pseudo-random
    half, blind to the digits (a split by digit, e.g. odd vs even operands, teaches the warm-up a digit
    bias that the RL prompts then break)."""
    return random.Random(a * 100 + b).random() < 0.5


def _calc_pairs(count: int, rng: random.Random, demos: bool, task: str) -> list[tuple[int, int]]:
    """`count` distinct operand pairs from the demonstrations' half (`demos`) or the prompts' half."""
    pool = [(a, b) for a in CALC_OPERANDS for b in CALC_OPERANDS if _for_demos(a, b) == demos]
    if count > len(pool):
        raise ValueError(f"{task}: cannot make {count} distinct sums of two-digit numbers (at most {len(pool)})")
    return rng.sample(pool, count)


def calc_rows(count: int, rng: random.Random) -> list[dict[str, str]]:
    """The agent quickstart's prompts `{"prompt": "37+58", "answer": "95"}`: a sum a tiny model cannot
    compute, only read from the `calculator` tool; never one of `calc_tool_demos`' sums."""
    return [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in _calc_pairs(count, rng, False, "calc")]


CALC_DIRECT_SHARE = 0.25
"""Share of `calc_tool_demos` that answer at once, without the tool: the warmed-up model then calls the
tool about half of the time, and RL has to find out that only the calls get sums right."""


def calc_tool_demo_rows(count: int, rng: random.Random) -> list[dict]:
    """`count` distinct demonstrations `{"messages": [user, assistant tool call, tool, assistant], "tools":
    [calculator]}` of the built-in `calculator` tool (its schema as the run offers it), `CALC_DIRECT_SHARE`
    of them `[user, assistant]` answering directly; none is a sum of `calc`'s prompts."""
    from transformers.utils import get_json_schema

    from megarl.tools.builtin.calculator import calculator

    schema = get_json_schema(calculator)
    rows = []
    for a, b in _calc_pairs(count, rng, True, "calc_tool_demos"):
        call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}+{b}"}}}}</tool_call>'
        messages = [
            {"role": "user", "content": f"{a}+{b}"},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)},
        ]
        if rng.random() < CALC_DIRECT_SHARE:
            messages = [messages[0], messages[3]]
        rows.append({"messages": messages, "tools": [schema]})
    return rows


TASKS: dict[str, Callable[[int, random.Random], list[dict]]] = {
    "repeat_first_char": repeat_first_char_rows,
    "calc": calc_rows,
    "calc_tool_demos": calc_tool_demo_rows,
}
"""Synthetic tasks by name: a generator of `count` distinct rows from a seeded RNG (prompt tasks: `prompt`,
`answer`; demonstration tasks: `messages`, `tools`, for `megarl sft`)."""
