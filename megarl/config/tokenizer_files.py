"""A tokenizer directory checked from its files alone: it must hold a vocabulary, its ids (those of the special
tokens it names included) must fit the model, and it must carry a chat template where the data needs one.

transformers builds an empty tokenizer (length 1) from a directory that lacks vocabulary files, and
every prompt then encodes to 0 tokens; a tokenizer with ids beyond the model's embedding rows fails
only inside the first forward pass. Both are found here by reading JSON and text files: no tokenizer
code (and no code shipped with a checkpoint) runs.
"""

import json
from pathlib import Path

from megarl.config.problems import Problem
from megarl.models.hf_config import ModelDims

VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")
"""Files that carry a vocabulary (transformers' fast, SentencePiece, BPE, WordPiece and Tekken tokenizers)."""


def tokenizer_problems(key: str, value: str, directory: Path, model: tuple[ModelDims, str] | None) -> list[Problem]:
    """Problems of the tokenizer in `directory` (named by setting `key` = `value`); with the model's dims and
    where they were read (`load_model_dims`), also ids beyond its vocabulary."""
    present = [name for name in VOCABULARY_FILES if (directory / name).is_file()]
    if not present:
        return [
            Problem(
                key,
                value,
                f"{directory} holds no tokenizer vocabulary (none of {', '.join(VOCABULARY_FILES)}): "
                "transformers would build an empty tokenizer and every prompt would be 0 tokens",
                "copy the model's tokenizer files into it, or set model.tokenizer_path to a directory that holds them",
            )
        ]
    if model is None:
        return []
    dims, source = model
    try:
        size = tokenizer_size(directory, present[0])
        missing = _special_tokens_outside(directory, present[0])
    except (OSError, ValueError, TypeError) as error:  # TypeError: JSON of an unexpected shape
        return [
            Problem(
                key,
                value,
                f"{directory / present[0]} cannot be read: {error}",
                "restore the tokenizer files from the model's original checkpoint",
            )
        ]
    if size is None:
        return []
    if size > dims.vocab_size:
        return [
            Problem(
                key,
                value,
                f"the tokenizer in {directory} has {size} ids (0 to {size - 1}) but the model has "
                f"only {dims.vocab_size} embedding rows (vocab_size in {source})",
                "use the tokenizer that belongs to this model, or a model whose vocabulary covers this tokenizer",
            )
        ]
    if size + len(missing) <= dims.vocab_size:
        return []
    named = ", ".join(f"{name} {token!r}" for name, token in missing)
    return [
        Problem(
            key,
            value,
            f"{directory / 'tokenizer_config.json'} names {named}, not in the vocabulary of "
            f"{present[0]}: transformers would add it as id {size} or above, beyond the model's "
            f"{dims.vocab_size} embedding rows (vocab_size in {source})",
            "name a token of the vocabulary there (e.g. the tokenizer's own end-of-text token), or restore "
            "the model's original tokenizer_config.json",
        )
    ]


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
"""Keys of tokenizer_config.json that name a special token (a string, or {"content": ...})."""


def _special_tokens_outside(directory: Path, vocabulary_file: str) -> list[tuple[str, str]]:
    """(key, token) of each special token tokenizer_config.json names that the vocabulary lacks (transformers
    appends such a token to the vocabulary); empty when the vocabulary is binary (read only by its library)."""
    config = directory / "tokenizer_config.json"
    if vocabulary_file not in ("tokenizer.json", "vocab.json") or not config.is_file():
        return []
    settings = _json_object(config)
    tokens = _vocabulary_tokens(directory / vocabulary_file)
    tokens |= {
        entry.get("content")
        for entry in (settings.get("added_tokens_decoder") or {}).values()
        if isinstance(entry, dict)
    }
    named = [(name, settings.get(name)) for name in SPECIAL_TOKENS]
    named = [(name, token.get("content") if isinstance(token, dict) else token) for name, token in named]
    return [(name, token) for name, token in named if isinstance(token, str) and token and token not in tokens]


def _vocabulary_tokens(path: Path) -> set:
    """The token strings of a tokenizer.json (its model's vocabulary and added tokens) or a vocab.json."""
    content = _json_object(path)
    if path.name == "vocab.json":
        return set(content)
    model = content.get("model") if isinstance(content.get("model"), dict) else {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: {token: id}
        tokens = set(vocab)
    else:  # Unigram: [[piece, score], ...]
        tokens = {piece[0] for piece in vocab or () if isinstance(piece, list) and piece}
    return tokens | {token.get("content") for token in content.get("added_tokens") or () if isinstance(token, dict)}


def chat_template_problem(key: str, value: str, directory: Path) -> Problem | None:
    """A problem when the tokenizer in `directory` carries no chat template (data.chat_template: true
    renders prompts with it): none in tokenizer_config.json, chat_template.jinja or chat_template.json."""
    config = directory / "tokenizer_config.json"
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return None
    try:
        if config.is_file() and _json_object(config).get("chat_template"):
            return None
    except (OSError, ValueError):
        return None  # a damaged tokenizer_config.json: loading the tokenizer reports it
    return Problem(
        "data.chat_template",
        True,
        f"the tokenizer ({key} = {value}) has no chat template (none in "
        "tokenizer_config.json, no chat_template.jinja or chat_template.json)",
        "set data.chat_template: false to use the prompts as raw text, give a Jinja template string, or "
        "use the model's instruct tokenizer",
    )


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
