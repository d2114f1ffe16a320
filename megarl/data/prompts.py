"""Prompt datasets: rows from files → checked, templated, tokenized `Prompt`s, with a report of what was dropped.

Which bad input is skipped (and counted in `LoadReport.skipped`) and which is an error (`DataError`):

| input | outcome |
|---|---|
| missing file, unsupported suffix, corrupt JSON line, wrong Parquet prompt type | error (see `files`) |
| a file without rows | error naming the file |
| prompt (or answer) column absent from every row of a file | error naming the file, the column and the columns found |
| one row without the prompt / with a null prompt | skipped: `missing_prompt` |
| one row without the answer / with a null answer | skipped: `missing_answer` |
| an empty (or whitespace-only) prompt, or an empty message list | skipped: `empty_prompt` |
| a prompt that is neither a string nor a list of {role, content} messages | skipped: `invalid_prompt` |
| a line with non-UTF-8 bytes, or a string that cannot be encoded as UTF-8 | skipped: `undecodable` |
| a prompt longer than `max_prompt_length` tokens | skipped: `overlong` (error if `filter_overlong_prompts` is false) |
| chat messages while `chat_template` is false | error (a setting mismatch, not a bad row) |
| nothing left after skipping | error with the counts |
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config.sections import DataConfig
from megarl.data.files import DataError, read_rows
from megarl.data.template import PromptRenderer

logger = logging.getLogger(__name__)

SKIP_REASONS = ("missing_prompt", "missing_answer", "empty_prompt", "invalid_prompt", "undecodable", "overlong")
"""Why a row can be skipped; the keys of `LoadReport.skipped`."""

ANSWER_ARGUMENT = "answer"
"""Reward functions receive the `data.answer_key` column under this keyword, whatever the column's name."""

_EXAMPLES_PER_REASON = 3


@dataclass(frozen=True)
class Prompt:
    """One prompt, ready for the rollout (token ids) and the reward (answer, other columns)."""

    text: str
    """The prompt as the model sees it: the chat template applied (or the raw text without one)."""
    token_ids: tuple[int, ...]
    """Token ids of `text`, at most `max_prompt_length` long."""
    answer: Any
    """The `data.answer_key` column: the reference answer handed to the reward function as `answer=`."""
    columns: dict[str, Any]
    """The row's other columns (not prompt, not answer), handed to the reward function by name."""
    source: str
    """Where the row came from: `file:line` (JSONL) or `file row i` (Parquet); for messages."""


@dataclass
class LoadReport:
    """What loading prompt files kept and dropped."""

    rows: int = 0
    """Rows read from the files (blank JSONL lines excluded)."""
    kept: int = 0
    """Prompts kept."""
    skipped: Counter = field(default_factory=Counter)
    """Rows dropped, by reason (`SKIP_REASONS`)."""
    examples: dict[str, list[str]] = field(default_factory=dict)
    """The first few locations of each skip reason, for the log."""

    def skip(self, reason: str, location: str) -> None:
        self.skipped[reason] += 1
        places = self.examples.setdefault(reason, [])
        if len(places) < _EXAMPLES_PER_REASON:
            places.append(location)

    def summary(self) -> str:
        """One line: `kept 2040 of 2048 rows; skipped: overlong 5 (train.jsonl:3, ...), empty_prompt 3 (...)`."""
        line = f"kept {self.kept} of {self.rows} rows"
        if self.skipped:
            parts = [
                f"{reason} {count} ({', '.join(self.examples[reason])}{', ...' if count > len(self.examples[reason]) else ''})"
                for reason, count in sorted(self.skipped.items())
            ]
            line += "; skipped: " + ", ".join(parts)
        return line

    def metrics(self, prefix: str) -> dict[str, float]:
        """`{prefix}/rows`, `{prefix}/kept` and `{prefix}/skipped/<reason>` for every reason (zeros included)."""
        metrics = {f"{prefix}/rows": float(self.rows), f"{prefix}/kept": float(self.kept)}
        metrics.update({f"{prefix}/skipped/{reason}": float(self.skipped[reason]) for reason in SKIP_REASONS})
        return metrics


def load_prompts(
    files: Sequence[str | Path], tokenizer, data: DataConfig, tools: list[dict] | None = None
) -> tuple[list[Prompt], LoadReport]:
    """Read, check, template and tokenize the prompts of `files` (in order) per the `data` section.

    tokenizer: an HF tokenizer (`__call__`, `apply_chat_template`). Uses data.prompt_key, answer_key,
    chat_template, max_prompt_length, filter_overlong_prompts. Raises `DataError` (see module doc).
    """
    renderer = PromptRenderer(tokenizer, data.chat_template, tools)
    report = LoadReport()
    prompts: list[Prompt] = []
    for path in files:
        prompts += _load_file(Path(path), renderer, data, report)
    report.kept = len(prompts)
    if not prompts:
        raise DataError(
            f"no usable prompt in {', '.join(map(str, files))}: {report.summary()}; "
            "fix the rows or the data.* settings named by the skip reasons"
        )
    (logger.warning if report.skipped else logger.info)(
        "prompts from %s: %s", ", ".join(map(str, files)), report.summary()
    )
    return prompts, report


def reward_columns(prompts: Sequence[Prompt]) -> dict[str, list]:
    """The keyword arguments of a reward call for these prompts (one entry per sample, same order):
    `answer` plus every other column by name (None where a row lacks it)."""
    names = sorted({name for prompt in prompts for name in prompt.columns})
    columns = {ANSWER_ARGUMENT: [prompt.answer for prompt in prompts]}
    columns.update({name: [prompt.columns.get(name) for prompt in prompts] for name in names})
    return columns


def _load_file(path: Path, renderer: PromptRenderer, data: DataConfig, report: LoadReport) -> list[Prompt]:
    """The kept prompts of one file; skips are recorded in `report`."""
    rows, texts, keys_seen = [], [], set()
    seen_prompt = seen_answer = False
    rows_before = report.rows
    for location, fields in read_rows(path, data.prompt_key):
        report.rows += 1
        if fields is None:
            report.skip("undecodable", location)
            continue
        keys_seen.update(fields)
        seen_prompt |= data.prompt_key in fields
        seen_answer |= data.answer_key in fields
        reason = _row_problem(fields, data)
        text = renderer.render(fields[data.prompt_key], location) if reason is None else ""
        if reason is None and not _encodable(text):
            reason = "undecodable"
        if reason is not None:
            report.skip(reason, location)
            continue
        rows.append((location, fields))
        texts.append(text)
    if report.rows == rows_before:
        raise DataError(f"{path}: the file holds no rows; fill it or remove it from the data files")
    for key, seen, setting in (
        (data.prompt_key, seen_prompt, "prompt_key"),
        (data.answer_key, seen_answer, "answer_key"),
    ):
        if keys_seen and not seen:  # (a file of undecodable lines only has no columns to name)
            raise DataError(
                f"{path}: no row has the column {key!r} (data.{setting}); the rows have "
                f"{sorted(keys_seen)}: set data.{setting} to one of them"
            )
    return _tokenized(rows, texts, renderer, data, report)


def _row_problem(fields: dict, data: DataConfig) -> str | None:
    """The skip reason of a row, judged before templating; None if it is usable."""
    prompt = fields.get(data.prompt_key)
    if prompt is None:
        return "missing_prompt"
    if fields.get(data.answer_key) is None:
        return "missing_answer"
    if isinstance(prompt, str):
        return None if prompt.strip() else "empty_prompt"
    if not isinstance(prompt, list) or not all(_is_message(message) for message in prompt):
        return "invalid_prompt"
    return None if any(message["content"].strip() for message in prompt) else "empty_prompt"


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
    )


def _encodable(text: str) -> bool:
    # JSON escapes can produce lone surrogates ("\udc80"), which no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _tokenized(
    rows: list[tuple[str, dict]], texts: list[str], renderer: PromptRenderer, data: DataConfig, report: LoadReport
) -> list[Prompt]:
    token_ids = renderer.tokenize(texts)
    prompts = []
    for (location, fields), text, ids in zip(rows, texts, token_ids):
        if len(ids) > data.max_prompt_length:
            if not data.filter_overlong_prompts:
                raise DataError(
                    f"{location}: the prompt is {len(ids)} tokens, over data.max_prompt_length "
                    f"{data.max_prompt_length}; raise the limit, shorten the prompt, or set "
                    "data.filter_overlong_prompts: true to skip such prompts"
                )
            report.skip("overlong", location)
            continue
        columns = {key: value for key, value in fields.items() if key not in (data.prompt_key, data.answer_key)}
        if ANSWER_ARGUMENT in columns:
            raise DataError(
                f"{location}: the column {ANSWER_ARGUMENT!r} clashes with the answer column "
                f"{data.answer_key!r} (data.answer_key), which reward functions receive as "
                f"`{ANSWER_ARGUMENT}=`; rename one of them"
            )
        prompts.append(
            Prompt(text=text, token_ids=tuple(ids), answer=fields[data.answer_key], columns=columns, source=location)
        )
    return prompts
