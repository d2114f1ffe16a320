"""Fixtures of the data tests: the tiny models' char tokenizer and a writer of prompt files."""

import json

import pytest

from megarl.models.tiny import build_char_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The char-level tokenizer of `megarl.models.tiny` (one token per character, chat template included)."""
    return build_char_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path):
    """write_jsonl(name, rows) -> path; a row is a dict (dumped as JSON) or raw bytes (written as is)."""

    def write(name, rows):
        path = tmp_path / name
        path.write_bytes(b"".join(row if isinstance(row, bytes) else json.dumps(row).encode() + b"\n" for row in rows))
        return path

    return write
