"""Demonstration conversations for supervised fine-tuning (`megarl sft`): checked, templated, tokenized,
with a loss mask that covers exactly the assistant messages' tokens.

A row (JSONL line, or Parquet row) is one conversation:

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...],
     "tools": [{"type": "function", "function": {"name": ..., "parameters": {...}}}, ...]}   # optional

It is rendered with the tokenizer's chat template (`apply_chat_template(messages, tools=tools)`). The
loss mask is found by rendering prefixes: assistant message `i` owns the tokens between the render of
`messages[:i]` with the generation prompt (the assistant turn opened) and the render of
`messages[:i + 1]`; that is its content and the template's end of turn, never the role header. A
template whose prefixes are not token prefixes of the whole conversation is an error (its mask would
be a guess).

    samples = load_sft_samples(["demos.jsonl"], tokenizer, max_length=512, truncate=False)
    for step, rows in enumerate(sft_batches(samples, batch_size=8, epochs=2, seed=0, shuffle=True)):
        ...   # megarl.trainer.sft.sft_policy_batch(rows, pad_id): the actor's PolicyBatch

Every bad row is an error (`DataError` listing each: file:line, the field, what is wrong, the fix).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2

from megarl.data.files import DataError, read_rows

ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED = 20
"""Bad rows listed in one `DataError` (the count of the others follows)."""


@dataclass(frozen=True)
class SftSample:
    """One tokenized conversation."""

    location: str
    """Where the row came from: `<file>:<line>` (JSONL) or `<file> row <i>` (Parquet)."""
    input_ids: tuple[int, ...]
    """Token ids of the whole rendered conversation."""
    loss_mask: tuple[bool, ...]
    """Per token of `input_ids`: True on assistant tokens (the ones the loss trains)."""


def row_problems(fields: dict | None) -> list[str]:
    """What is wrong with one row (each `field: why; fix`), empty when it can be used."""
    if fields is None:
        return ["the line is not UTF-8 text; fix: save the file as UTF-8"]
    messages = fields.get("messages")
    if messages is None:
        return ['"messages" is missing; fix: give {"messages": [{"role": ..., "content": ...}, ...]}']
    if not isinstance(messages, list) or not messages:
        return [
            f'"messages" is {_kind(messages)}, not a non-empty list; fix: give a list of '
            '{"role": ..., "content": ...} messages'
        ]
    problems = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            problems.append(f'{where} is {_kind(message)}; fix: write it as {{"role": ..., "content": ...}}')
            continue
        role = message.get("role")
        if role not in ROLES:
            problems.append(f"{where}.role is {role!r}; fix: use one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            problems.append(
                f"{where}.content is {_kind(message.get('content'))}, not a string; fix: write the "
                "message's text as one string (tool calls go in the assistant content)"
            )
    if not problems and not any(message["role"] == "assistant" for message in messages):
        problems.append(
            '"messages" has no assistant message, so nothing would be trained; fix: add the '
            "assistant's turns (or drop the row)"
        )
    tools = fields.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        problems.append(
            f'"tools" is {_kind(tools)}; fix: give a list of OpenAI function schemas '
            '({"type": "function", "function": {"name": ..., "parameters": ...}}) or leave it out'
        )
    return problems


def _kind(value) -> str:
    """A JSON value described in JSON's terms (a row's fields come from JSON or Parquet)."""
    if value is None:
        return "missing (null)"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, (list, dict)) and not value:
        return "empty"
    names = {bool: "true/false", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return names.get(type(value), f"a {type(value).__name__}")


def tokenize_conversation(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[bool]]:
    """`(input_ids, loss_mask)` of a checked conversation (see the module docstring); ValueError when
    the template renders a prefix of the conversation as something else than a prefix of the whole."""
    ids = _render(tokenizer, messages, tools, generation_prompt=False)
    mask = [False] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_prefix(tokenizer, messages[:index], tools, True, ids))
        end = len(_prefix(tokenizer, messages[: index + 1], tools, False, ids))
        mask[start:end] = [True] * (end - start)
    return ids, mask


def _render(tokenizer, messages, tools, generation_prompt: bool) -> list[int]:
    # Templated text holds the model's special tokens already: tokenize it without adding any.
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prefix(tokenizer, messages, tools, generation_prompt: bool, whole: list[int]) -> list[int]:
    ids = _render(tokenizer, messages, tools, generation_prompt) if messages or generation_prompt else []
    if whole[: len(ids)] != ids:
        raise ValueError(
            f"the chat template renders the first {len(messages)} message(s)"
            f"{' with the generation prompt' if generation_prompt else ''} as tokens that do not start the whole "
            "conversation, so the assistant tokens cannot be located; use a template whose turns only append"
        )
    return ids


def load_sft_samples(files: Sequence[str | Path], tokenizer, *, max_length: int, truncate: bool) -> list[SftSample]:
    """Every conversation of `files`, in order. A conversation longer than `max_length` tokens is an
    error, or with `truncate` cut to its first `max_length` tokens (it must keep an assistant token).
    Raises `DataError` listing every bad row."""
    samples, problems = [], []
    for path in files:
        for location, fields in read_rows(path, "messages"):
            found = row_problems(fields)
            if not found:
                try:
                    ids, mask = tokenize_conversation(tokenizer, fields["messages"], fields.get("tools"))
                except (jinja2.TemplateError, ValueError, TypeError) as error:
                    found = [
                        f"the chat template failed on this row ({type(error).__name__}: {error}); fix: correct "
                        "the row, or use a tokenizer whose template renders it"
                    ]
            truncated = not found and len(ids) > max_length
            if truncated and not truncate:
                found = [
                    f"{len(ids)} tokens > data.max_length={max_length}; fix: raise data.max_length, "
                    "shorten the conversation, or set data.truncate: true (keeps the first max_length tokens)"
                ]
            elif truncated:
                ids, mask = ids[:max_length], mask[:max_length]
            if not found and not any(mask[1:]):
                found = [
                    f"no assistant token within the first {max_length} tokens (data.max_length); fix: raise "
                    "data.max_length or shorten the turns before the first assistant message"
                    if truncated
                    else "the chat template renders no token for the assistant messages; fix: give them content"
                ]
            if found:
                problems += [f"{location}: {problem}" for problem in found]
            else:
                samples.append(SftSample(location, tuple(ids), tuple(mask)))
    if problems:
        shown = problems[:MAX_REPORTED]
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise DataError(f"{len(problems)} bad row(s) in the SFT data:\n  " + "\n  ".join(shown) + more)
    return samples


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    """Full batches in one pass (the last incomplete batch is left out)."""
    return num_samples // batch_size


def sft_batches(
    samples: Sequence[SftSample], *, batch_size: int, epochs: int, seed: int, shuffle: bool
) -> Iterator[list[SftSample]]:
    """`epochs` passes of full batches; with `shuffle`, epoch `e` is ordered by `random.Random(seed + e)`."""
    if steps_per_epoch(len(samples), batch_size) < 1:
        raise DataError(
            f"the SFT data has {len(samples)} conversation(s), fewer than one batch of "
            f"train.batch_size={batch_size}; add conversations or lower train.batch_size"
        )
    for epoch in range(epochs):
        order = list(range(len(samples)))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        for step in range(steps_per_epoch(len(samples), batch_size)):
            yield [samples[i] for i in order[step * batch_size : (step + 1) * batch_size]]
