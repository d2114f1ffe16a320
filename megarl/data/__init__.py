"""Prompt datasets (JSONL, Parquet): checked, templated, tokenized, and batched reproducibly.

    loader, report = train_loader(config.data, tokenizer)     # PromptLoader, LoadReport
    batch = next(loader)                                       # list[Prompt], data.train_batch_size long
    columns = reward_columns(batch)                            # {"answer": [...], other columns: [...]}
    val, val_report = load_prompts(config.data.val_files, tokenizer, config.data)
    for batch in iter_batches(val, config.data.val_batch_size): ...

Bad input is either skipped and counted (`LoadReport.skipped`, logged with locations) or a
`DataError` naming the file and row; the table is in `megarl.data.prompts`.
"""

from megarl.config.sections import DataConfig
from megarl.data.files import DataError, read_rows
from megarl.data.loader import PromptLoader, iter_batches
from megarl.data.prompts import ANSWER_ARGUMENT, SKIP_REASONS, LoadReport, Prompt, load_prompts, reward_columns
from megarl.data.template import PromptRenderer


def train_loader(data: DataConfig, tokenizer, tools: list[dict] | None = None) -> tuple[PromptLoader, LoadReport]:
    """The training prompts of `data.train_files` in batches of `data.train_batch_size`,
    shuffled per epoch by `data.seed` when `data.shuffle`; `tools`: schemas for the chat template."""
    prompts, report = load_prompts(data.train_files, tokenizer, data, tools)
    return PromptLoader(prompts, data.train_batch_size, shuffle=data.shuffle, seed=data.seed), report


__all__ = [
    "ANSWER_ARGUMENT",
    "SKIP_REASONS",
    "DataError",
    "LoadReport",
    "Prompt",
    "PromptLoader",
    "PromptRenderer",
    "iter_batches",
    "load_prompts",
    "read_rows",
    "reward_columns",
    "train_loader",
]
