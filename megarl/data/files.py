"""Reading rows from prompt files (JSONL, Parquet), each row tagged with where it came from.

What is an error and what is skipped is decided here for the file's *structure*; the content of
a row (empty prompt, missing field, ...) is judged by `megarl.data.prompts`.

Errors (`DataError`, naming the file, the row and the fix):
- the file is missing, has another suffix, or is not readable as its format (a UTF-16 or UTF-32
  JSONL file is named as such, as is a compressed one, e.g. a `.jsonl` that is gzip data; a UTF-8
  byte-order mark is read past);
- a JSONL line that is not JSON, or JSON that is not an object (a truncated or corrupt file:
  skipping it would hide the damage);
- a Parquet prompt column whose type is neither a string nor a list of chat messages.

Skipped (counted by the caller): a JSONL line whose bytes are not UTF-8 (its location is yielded
with `fields=None`). Blank JSONL lines are not rows at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.text_encoding import iconv_hint, wide_encoding

SUFFIXES = (".jsonl", ".parquet")


class DataError(ValueError):
    """A prompt file cannot be used; the message names the file (and row), what is wrong and the fix."""


def read_rows(path: str | Path, prompt_key: str) -> Iterator[tuple[str, dict | None]]:
    """Yield `(location, fields)` for every row of `path`; `fields` is None for undecodable bytes.

    location: `"<path>:<line>"` (1-based line) for JSONL, `"<path> row <i>"` (0-based) for Parquet.
    `prompt_key` is used to check a Parquet schema before any row is read.
    """
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; convert it to one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise DataError(f"{path}: no such file; correct the path (relative paths start at the working directory)")
    if path.suffix == ".jsonl":
        yield from _jsonl_rows(path)
    else:
        yield from _parquet_rows(path, prompt_key)


_UTF8_BOM = b"\xef\xbb\xbf"

# Magic numbers of compressed files, with the command that writes the plain text to stdout.
_COMPRESSED = (
    (b"\x1f\x8b", "gzip", "gunzip -c"),
    (b"BZh", "bzip2", "bunzip2 -c"),
    (b"\xfd7zXZ\x00", "xz", "xz -dc"),
    (b"\x28\xb5\x2f\xfd", "zstd", "zstd -dc"),
    (b"PK\x03\x04", "zip", "unzip -p"),
)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict | None]]:
    # Bytes, not text mode: one bad byte must cost one line, not the whole file.
    with path.open("rb") as handle:
        head = handle.read(6)
        _check_compression(path, head)
        _check_encoding(path, head)
        handle.seek(len(_UTF8_BOM) if head.startswith(_UTF8_BOM) else 0)  # a UTF-8 BOM is UTF-8: read past it
        for number, raw in enumerate(handle, start=1):
            location = f"{path}:{number}"
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield location, None
                continue
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{location}: not valid JSON ({error.msg} at column {error.colno}); "
                    "a JSONL file holds one JSON object per line: fix or remove the line"
                ) from None
            if not isinstance(fields, dict):
                raise DataError(
                    f"{location}: a JSON {type(fields).__name__} where a JSON object "
                    '(e.g. {"prompt": ..., "answer": ...}) is expected; one object per line'
                )
            yield location, fields


def _check_compression(path: Path, head: bytes) -> None:
    """A compressed file named .jsonl: read as text, its binary lines would all be skipped as undecodable."""
    for magic, kind, command in _COMPRESSED:
        if head.startswith(magic):
            raise DataError(
                f"{path}: the file is {kind}-compressed, megarl reads plain UTF-8 JSONL; decompress it, "
                f"e.g. {command} {path} > {path.with_suffix('.plain.jsonl')}, and list that file"
            )


def _check_encoding(path: Path, head: bytes) -> None:
    """A UTF-16 or UTF-32 file named as such: read as UTF-8, its every line would be a bad line."""
    encoding = wide_encoding(head)
    if encoding is not None:
        raise DataError(
            f"{path}: the file is {encoding}-encoded text, megarl reads UTF-8 JSONL; convert it, e.g. "
            f"{iconv_hint(path, encoding, path.with_suffix('.utf8.jsonl'))}"
        )


def _parquet_rows(path: Path, prompt_key: str) -> Iterator[tuple[str, dict]]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file ({error}); re-export it") from None
    schema = parquet.schema_arrow
    if prompt_key in schema.names:
        _check_prompt_type(path, prompt_key, schema.field(prompt_key).type)
    index = 0
    for batch in parquet.iter_batches():
        for fields in batch.to_pylist():
            yield f"{path} row {index}", fields
            index += 1


def _check_prompt_type(path: Path, prompt_key: str, kind: pa.DataType) -> None:
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_struct(kind.value_type):
        names = {kind.value_type.field(i).name for i in range(kind.value_type.num_fields)}
        if {"role", "content"} <= names:
            return
    raise DataError(
        f"{path}: column {prompt_key!r} has Parquet type {kind}; a prompt column must be a string or "
        "a list of {role, content} chat messages: convert the column or point data.prompt_key at another"
    )
