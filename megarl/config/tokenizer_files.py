"""A tokenizer directory checked from its files alone: it must hold a vocabulary, and its ids must fit the model.

transformers builds an empty tokenizer (length 1) from a directory that lacks vocabulary files, and
every prompt then encodes to 0 tokens; a tokenizer with ids beyond the model's embedding rows fails
only inside the first forward pass. Both are found here by reading JSON and text files: no tokenizer
code (and no code shipped with a checkpoint) runs.
"""

import json
from pathlib import Path

from megarl.config.model_facts import ModelFacts
from megarl.config.problems import Problem

VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")
"""Files that carry a vocabulary (transformers' fast, SentencePiece, BPE, WordPiece and Tekken tokenizers)."""


def tokenizer_problems(key: str, value: str, directory: Path, facts: ModelFacts | None) -> list[Problem]:
    """Problems of the tokenizer in `directory` (named by setting `key` = `value`); with the model's
    `facts`, also ids beyond its vocabulary."""
    present = [name for name in VOCABULARY_FILES if (directory / name).is_file()]
    if not present:
        return [Problem(key, value, f"{directory} holds no tokenizer vocabulary (none of {', '.join(VOCABULARY_FILES)}): "
                                    "transformers would build an empty tokenizer and every prompt would be 0 tokens",
                        "copy the model's tokenizer files into it, or set model.tokenizer_path to a directory that "
                        "holds them")]
    if facts is None:
        return []
    try:
        size = tokenizer_size(directory, present[0])
    except (OSError, ValueError, TypeError) as error:  # TypeError: JSON of an unexpected shape
        return [Problem(key, value, f"{directory / present[0]} cannot be read: {error}",
                        "restore the tokenizer files from the model's original checkpoint")]
    if size is None or size <= facts.vocab_size:
        return []
    return [Problem(key, value, f"the tokenizer in {directory} has {size} ids (0 to {size - 1}) but the model has only "
                                f"{facts.vocab_size} embedding rows (vocab_size in {facts.source})",
                    "use the tokenizer that belongs to this model, or a model whose vocabulary covers this tokenizer")]


def tokenizer_size(directory: Path, vocabulary_file: str) -> int | None:
    """1 + the largest token id of the tokenizer in `directory` (its vocabulary file and the added tokens
    of tokenizer_config.json), or None for a binary vocabulary (SentencePiece, Tekken) read only by its library."""
    path = directory / vocabulary_file
    if vocabulary_file == "tokenizer.json":
        content = _json_object(path)
        model = content.get("model") or {}
        ids = _vocabulary_ids(model.get("vocab") if isinstance(model, dict) else None)
        ids += [token.get("id") for token in content.get("added_tokens") or () if isinstance(token, dict)]
    elif vocabulary_file == "vocab.json":
        ids = _vocabulary_ids(_json_object(path))
    elif vocabulary_file == "vocab.txt":
        ids = [len(path.read_text(encoding="utf-8").splitlines()) - 1]  # WordPiece: one token per line
    else:
        return None
    config = directory / "tokenizer_config.json"
    if config.is_file():
        ids += [int(i) for i in _json_object(config).get("added_tokens_decoder") or {} if str(i).isdigit()]
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    return max(ids) + 1 if ids else None


def _json_object(path: Path) -> dict:
    content = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(content, dict):
        raise ValueError(f"a JSON {type(content).__name__} where a JSON object was expected")
    return content


def _vocabulary_ids(vocab) -> list:
    """Token ids of a vocabulary: {token: id} (BPE, WordPiece, WordLevel) or [[piece, score], ...] (Unigram)."""
    if isinstance(vocab, dict):
        return list(vocab.values())
    if isinstance(vocab, list):
        return [len(vocab) - 1] if vocab else []
    return []
