"""A public dataset's train and test rows → megarl prompt files, and the summary that sizes the recipe.

Output (under `--out`):
- `train.parquet`, `test.parquet`: one row per prompt, `prompt` and `answer` (what `data.prompt_key` and
  `data.answer_key` read by default) plus the convention's kept columns. `prompt` is a chat message list
  `[{"role": "user", "content": ...}]` for instruct models (the recipe keeps `data.chat_template: true`,
  the model's own template is applied when the run loads it) or the plain text for base models
  (`data.chat_template: false`);
- `summary.json`: rows read, kept and dropped by reason per split, the prompt length percentiles in tokens
  of the model's tokenizer, and the `data.*` / `reward.function` settings that fit these files.

Prompt lengths are measured the way a run measures them: `megarl.data.template.PromptRenderer`, the
renderer of the prompt loader, with the same template choice.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl import interrupt
from megarl.data.conventions import Convention, convert_row
from megarl.data.dataset_source import Split
from megarl.data.template import PromptRenderer

PERCENTILES = (50, 90, 95, 99)
"""Prompt length percentiles in the summary (nearest rank: each is the length of a real prompt)."""


class PrepareError(ValueError):
    """Nothing usable is left of a split; the message names it and the drop reasons."""


@dataclass
class PreparedSplit:
    """One output split: its rows and what happened to the input rows."""

    name: str
    """`train` or `test`: the output file's name."""
    origin: str
    """Where the input rows came from (`Split.origin`)."""
    rows: list[dict]
    """Output rows (`prompt` as messages or text, `answer`, kept columns)."""
    read: int
    """Input rows read."""
    dropped: Counter
    """Input rows dropped, by reason (`megarl.data.conventions.DROP_REASONS`)."""
    prompt_tokens: list[int]
    """Token count of each kept prompt as the model sees it, same order as `rows`."""


def prepare_split(
    name: str, split: Split, convention: Convention, renderer: PromptRenderer, where: str
) -> PreparedSplit:
    """Convert and measure one split (its columns already checked, `check_columns`); `where` names the
    input in messages. Raises PrepareError, or DataError (a chat template that fails on a prompt)."""
    rows, dropped = [], Counter()
    for fields in split.rows:
        interrupt.check()  # a stop signal ends a large dataset between two rows
        row, reason = convert_row(fields, convention)
        if row is None:
            dropped[reason] += 1
        else:
            rows.append(row)
    if not rows:
        raise PrepareError(
            f"{where} ({split.origin}): none of its {len(split.rows)} rows is usable "
            f"(dropped: {_reasons(dropped)}); is it the {convention.name} schema, "
            f"with {convention.answer_column!r} holding solutions?"
        )
    texts = []
    for row in rows:
        interrupt.check()
        texts.append(renderer.render(row["prompt"], f"{where} ({split.origin})"))
    lengths = [len(ids) for ids in renderer.tokenize(texts)]
    if renderer.templated:
        rows = [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    return PreparedSplit(name, split.origin, rows, len(split.rows), dropped, lengths)


def length_stats(lengths: list[int]) -> dict[str, int]:
    """`{"min", "p50", "p90", "p95", "p99", "max"}` of `lengths` (nearest-rank percentiles)."""
    ordered = sorted(lengths)
    stats = {"min": ordered[0]}
    stats.update({f"p{p}": ordered[math.ceil(p / 100 * len(ordered)) - 1] for p in PERCENTILES})
    stats["max"] = ordered[-1]
    return stats


def summarize(
    splits: list[PreparedSplit], convention: Convention, out: Path, chat: bool, inputs: dict[str, str | None]
) -> dict:
    """The summary (see the module doc); `inputs`: the command's source, subset, model, prompt format."""
    longest = max(max(split.prompt_tokens) for split in splits)
    settings = {
        "data.train_files": [str(out / "train.parquet")],
        "data.val_files": [str(out / "test.parquet")],
        "data.prompt_key": "prompt",
        "data.answer_key": "answer",
        "data.chat_template": chat,
        "data.max_prompt_length": longest,
        "reward.function": convention.reward,
    }
    return {
        "dataset": convention.name,
        **inputs,
        "instruction": convention.instruction,
        "splits": {
            split.name: {
                "from": split.origin,
                "file": str(out / f"{split.name}.parquet"),
                "rows": split.read,
                "kept": len(split.rows),
                "dropped": dict(sorted(split.dropped.items())),
                "prompt_tokens": length_stats(split.prompt_tokens),
            }
            for split in splits
        },
        "settings": settings,
    }


def format_summary(summary: dict) -> str:
    """The summary as the command prints it."""
    lines = [
        f"{summary['dataset']} from {summary['source']}"
        + (f" (subset {summary['subset']})" if summary["subset"] else "")
        + f": {summary['prompt_format']} prompts, lengths in tokens of {summary['model']}"
    ]
    for name, split in summary["splits"].items():
        dropped = f"; dropped {_reasons(Counter(split['dropped']))}" if split["dropped"] else ""
        lines.append(
            f"{name} ({split['from']}): kept {split['kept']} of {split['rows']} rows{dropped} -> {split['file']}"
        )
        lines.append("  prompt tokens: " + ", ".join(f"{key} {value}" for key, value in split["prompt_tokens"].items()))
    lines.append(
        "recipe settings for these files (data.max_prompt_length: the longest prompt; a lower limit drops "
        "the prompts above it when data.filter_overlong_prompts is true):"
    )
    lines += [f"  {key}: {json.dumps(value)}" for key, value in summary["settings"].items() if value is not None]
    return "\n".join(lines)


def write_outputs(out: Path, splits: list[PreparedSplit], summary: dict) -> None:
    """Write train.parquet, test.parquet and summary.json into `out` (created); each file appears whole
    (written aside, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    for split in splits:
        write_whole(
            out / f"{split.name}.parquet",
            lambda path, rows=split.rows: pq.write_table(pa.Table.from_pylist(rows), path),
        )
    write_whole(out / "summary.json", lambda path: path.write_text(json.dumps(summary, indent=2) + "\n"))


def write_whole(target: Path, write) -> None:
    """`write(path)` to a hidden sibling of `target`, then renamed to it: `target` appears whole or not at
    all (a failed write removes its part; only a kill can leave the hidden `.<name>.partial`, which the
    next run replaces)."""
    partial = target.with_name(f".{target.name}.partial")
    try:
        write(partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)


def _reasons(dropped: Counter) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in sorted(dropped.items())) or "none"
