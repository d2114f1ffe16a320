"""A public dataset's rows, read through HF `datasets` without downloading, split into train and test.

`--source` is one of:
- a hub id (`openai/gsm8k`): its snapshot in the local HF cache (`HF_HUB_CACHE`), where `hf download
  <id> --repo-type dataset` or an earlier `datasets.load_dataset(<id>)` put it; read like a directory;
- a dataset directory (a snapshot, or `hf download --local-dir`): `datasets` reads its README's
  configs (`--subset` picks one, e.g. GSM8K's `main`) or its split-named files;
- one `.parquet` or `.jsonl` file: a single split.

The split: the dataset's own `train` and `test` (or `validation`) splits when it has them; a dataset of
one split is cut into a test share (`test_fraction`, seeded) and the rest for training. Any other set
of splits is a `SourceError` naming them.

`datasets` prepares Arrow files in a cache as it reads; a temporary one is used and removed, so the
user's datasets cache holds no stale copy that a changed file would be shadowed by.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megarl.config.hub import cached_snapshot, download_command, is_hub_id

FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json"}
"""A single input file's suffix → the `datasets` builder that reads it."""
TEST_SPLITS = ("test", "validation")
"""The dataset's own held-out split, by preference."""


class SourceError(ValueError):
    """The source cannot be read; the message names it, what is wrong and the fix."""


@dataclass(frozen=True)
class Split:
    """The rows of one output split and where they came from."""

    rows: list[dict]
    """The input rows, as dicts of the dataset's columns."""
    origin: str
    """Where the rows came from, for the summary: `split 'train'`, or `split 'train', seeded 90%`."""


def load_splits(
    source: str, subset: str | None, test_fraction: float, seed: int, check_columns: Callable[[list[str], str], None]
) -> tuple[Split, Split]:
    """(train, test) of `source` (see the module doc). Raises SourceError. `check_columns(columns, where)`
    sees each split's columns first and raises what it finds wrong (a file in another schema is named as
    such, before anything else is said about it)."""
    with tempfile.TemporaryDirectory(prefix="megarl-datasets-") as cache_dir:
        splits = _load(source, subset, cache_dir)
        for name, dataset in splits.items():
            check_columns(list(dataset.column_names), f"{source} (split {name!r})")
        if "train" in splits and any(name in splits for name in TEST_SPLITS):
            test_name = next(name for name in TEST_SPLITS if name in splits)
            return _whole(splits["train"], "train"), _whole(splits[test_name], test_name)
        if len(splits) == 1:
            ((name, dataset),) = splits.items()
            return _cut(dataset, name, source, test_fraction, seed)
    raise SourceError(
        f"{source}: the splits {sorted(splits)} are neither train + test (or validation) nor a single "
        "split to cut by --test-fraction; pass a file of one split, or a dataset that has train and test"
    )


def _load(source: str, subset: str | None, cache_dir: str):
    import datasets

    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise SourceError(
                f"--source {source}: unsupported file type {path.suffix!r}; give a "
                f"{' or '.join(FILE_BUILDERS)} file, a dataset directory or a hub id"
            )
        if subset is not None:
            raise SourceError(f"--subset {subset}: a single file has no subsets; leave --subset out")
        arguments = dict(path=FILE_BUILDERS[path.suffix], data_files=str(path))
    elif path.is_dir():
        arguments = dict(path=str(path), name=subset)
    elif is_hub_id(source):
        snapshot = cached_snapshot(source, repo_type="dataset")
        if snapshot is None:
            from huggingface_hub import constants

            raise SourceError(
                f"--source {source}: a hub id that is not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}), and megarl never downloads; download it first: "
                f"`{download_command(source, 'dataset')}` (HF_HUB_CACHE picks the cache), or give a "
                "local .parquet/.jsonl file or dataset directory"
            )
        arguments = dict(path=str(snapshot), name=subset)
    else:
        raise SourceError(
            f"--source {source}: no such file or directory, and not a hub id (org/name); correct the path"
        )
    # Its "Generating train split" bars report the temporary cache being filled, nothing the user waits on;
    # its error log of a file it cannot parse would repeat, with a traceback, what the SourceError says.
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return datasets.load_dataset(**arguments, cache_dir=cache_dir)
    except (ValueError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as error:
        # A subset that is not there, a subset left out where one is needed, a file `datasets` cannot parse.
        raise SourceError(
            f"--source {source}: `datasets` cannot read it ({_reason(error)}); pick the subset "
            "with --subset where the dataset has several, or fix the file"
        ) from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def _whole(dataset, name: str) -> Split:
    return Split(dataset.to_list(), f"split {name!r}")


def _cut(dataset, name: str, source: str, test_fraction: float, seed: int) -> tuple[Split, Split]:
    rows = dataset.to_list()
    test_count = round(len(rows) * test_fraction)
    if not 1 <= test_count < len(rows):
        raise SourceError(
            f"{source}: split {name!r} has {len(rows)} rows; --test-fraction {test_fraction} of them is "
            f"{test_count} test rows, and both train and test need at least one: change --test-fraction"
        )
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    test_share = round(100 * test_count / len(rows))
    test = Split([rows[i] for i in sorted(order[:test_count])], f"split {name!r}, seeded {test_share}% (--seed)")
    train = Split([rows[i] for i in sorted(order[test_count:])], f"split {name!r}, the other {100 - test_share}%")
    return train, test


def _reason(error: Exception) -> str:
    """The error's cause (a generation error's parse error says where the file is broken), its message up to
    `datasets`' usage example (which names Python calls, not megarl flags), on one line."""
    cause = error.__cause__ or error
    text = str(cause).split("Example of usage")[0]
    return f"{type(cause).__name__}: {' '.join(text.split())}"
