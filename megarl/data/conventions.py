"""How a public dataset's rows become megarl prompt rows: the conventions RL recipes are compared by.

| dataset | reads | prompt | answer (the reward's ground truth) | reward |
|---|---|---|---|---|
| `gsm8k` (openai/gsm8k) | `question`, `answer` | question + " " + `GSM8K_INSTRUCTION` | the number after the solution's last `#### ` (commas removed) | `gsm8k` |
| `math` (competition_math, MATH-lighteval, MATH-500) | `problem`, `solution` (+ `level`, `type`, `subject`) | problem + " " + `MATH_INSTRUCTION` | the content of the solution's last `\\boxed{}` | `math` |
| `jsonl` (any) | `--prompt-column`, `--answer-column` | the column, as is (+ an `--instruction`) | the column, as is | (yours) |

The instructions and the answer extraction are those of verl's GSM8K and MATH preprocessing
(examples/data_preprocess/gsm8k.py, math_dataset.py), so scores compare with runs made that way. The
answer is extracted with the reward's own parser (`megarl.rewards.gsm8k`, `megarl.rewards.boxed`):
what the data calls the answer is what the reward reads in a response.

A row this cannot use is dropped with a reason (`DROP_REASONS`); a missing column is a `SchemaError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megarl.rewards.boxed import last_boxed
from megarl.rewards.gsm8k import extract_final_answer

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

DROP_REASONS = ("missing_prompt", "missing_answer", "no_final_answer")
"""Why a row is dropped: no question text (absent, blank, or not a string); no (or a blank) answer text; an
answer text without the dataset's final-answer marker (GSM8K's `#### N`, MATH's `\\boxed{}`)."""


class SchemaError(ValueError):
    """The input is not in the dataset's schema (a column is missing); the message names the columns found."""


@dataclass(frozen=True)
class Convention:
    """One dataset's columns, instruction and answer extraction."""

    name: str
    """The `megarl make-data` dataset name."""
    prompt_column: str
    """Column holding the question."""
    answer_column: str
    """Column holding the reference solution (or answer)."""
    instruction: str
    """Appended to the question after a space; empty: none."""
    extract_answer: Callable[[str], str | None]
    """Solution text → the final answer the reward compares with; None when the text has none."""
    kept_columns: tuple[str, ...] = ()
    """Further input columns copied to the output when present (e.g. MATH's `level`, `type`), as strings."""
    reward: str | None = None
    """The built-in `reward.function` that scores this answer; None: the user's own."""


def gsm8k_convention(instruction: str | None = None) -> Convention:
    return Convention(
        "gsm8k",
        "question",
        "answer",
        GSM8K_INSTRUCTION if instruction is None else instruction,
        extract_final_answer,
        reward="gsm8k",
    )


def math_convention(instruction: str | None = None) -> Convention:
    return Convention(
        "math",
        "problem",
        "solution",
        MATH_INSTRUCTION if instruction is None else instruction,
        last_boxed,
        kept_columns=("level", "type", "subject"),
        reward="math",
    )


def generic_convention(prompt_column: str, answer_column: str, instruction: str | None = None) -> Convention:
    return Convention("jsonl", prompt_column, answer_column, instruction or "", lambda text: text.strip() or None)


CONVENTIONS = {"gsm8k": gsm8k_convention, "math": math_convention}
"""The named datasets; `jsonl` (`generic_convention`) takes its columns from the command line."""


def check_columns(convention: Convention, columns: list[str], where: str) -> None:
    """SchemaError naming `where` when the prompt or answer column is absent from `columns`."""
    missing = [name for name in (convention.prompt_column, convention.answer_column) if name not in columns]
    if missing:
        raise SchemaError(
            f"{where}: no column {', '.join(map(repr, missing))}; `megarl make-data {convention.name}` "
            f"reads {convention.prompt_column!r} and {convention.answer_column!r}, the input has "
            f"{sorted(columns)}: {_schema_hint(convention)}"
        )


def _schema_hint(convention: Convention) -> str:
    if convention.name == "jsonl":
        return "name its columns with --prompt-column and --answer-column"
    return (
        "use the dataset name that matches the input (gsm8k: question/answer; math: problem/solution), "
        "or `megarl make-data jsonl --prompt-column ... --answer-column ...` for another schema"
    )


def convert_row(fields: dict, convention: Convention) -> tuple[dict | None, str | None]:
    """`(row, None)`: the megarl row `{"prompt", "answer", kept columns...}` (prompt: the question and the
    instruction, plain text);
    `(None, reason)`: why the row is dropped (`DROP_REASONS`)."""
    question = fields.get(convention.prompt_column)
    if not isinstance(question, str) or not question.strip():
        return None, "missing_prompt"
    solution = fields.get(convention.answer_column)
    if solution is None or not str(solution).strip():
        return None, "missing_answer"
    answer = convention.extract_answer(str(solution))
    if answer is None:
        return None, "no_final_answer"
    text = f"{question.strip()} {convention.instruction}" if convention.instruction else question.strip()
    row = {"prompt": text, "answer": answer}
    row.update({name: str(fields[name]) for name in convention.kept_columns if fields.get(name) is not None})
    return row, None
