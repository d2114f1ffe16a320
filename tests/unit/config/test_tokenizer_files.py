"""The tokenizer's size read from its files, for each vocabulary format, against the tokenizers transformers loads."""

import json

import pytest
from transformers import AutoTokenizer

from megarl.config.tokenizer_files import tokenizer_size
from megarl.models.tiny import make_tiny_model


def test_size_of_a_fast_tokenizer_is_what_transformers_loads(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    assert tokenizer_size(model, "tokenizer.json") == len(AutoTokenizer.from_pretrained(model)) == 100


def test_added_tokens_of_tokenizer_config_count(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "c": 2}))
    decoder = {"7": {"content": "<|end|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    assert tokenizer_size(tmp_path, "vocab.json") == 8


@pytest.mark.parametrize(
    "name, text, size",
    [
        ("vocab.txt", "[PAD]\n[UNK]\nhello\nworld\n", 4),
        (
            "tokenizer.json",
            json.dumps(
                {
                    "model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["a", -1.0]]},
                    "added_tokens": [{"id": 5, "content": "<eos>"}],
                }
            ),
            6,
        ),
        ("tokenizer.model", "binary SentencePiece model", None),  # only its library reads it: not checked
    ],
)
def test_size_by_format(tmp_path, name, text, size):
    (tmp_path / name).write_text(text)
    assert tokenizer_size(tmp_path, name) == size
