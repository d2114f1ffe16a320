"""Hub ids (`org/name`) and the local Hugging Face cache: where a downloaded model lies on this machine.

megarl never downloads at run time. A hub id in `model.path`, `model.tokenizer_path` or
`reward.reward_model` must already be in the local HF cache (`HF_HUB_CACHE`, by default
~/.cache/huggingface/hub), put there by `hf download <id>`. The driver resolves each id once, with
huggingface_hub's own offline lookup (`snapshot_download(local_files_only=True)`: the snapshot that
`refs/main` names), and hands the workers directories only.

    config = resolve_hub_ids(config)   # model.path "Qwen/Qwen2.5-7B-Instruct" -> ".../snapshots/<commit>"
"""

import os
import re
from dataclasses import replace
from pathlib import Path

from megarl.config.config import Config
from megarl.config.problems import ConfigError, Problem
from megarl.config.resources import local_path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(path: str) -> bool:
    """`org/name` that is not an existing local path: a Hugging Face hub id."""
    return bool(_HUB_ID.fullmatch(path)) and not path.startswith(".") and not os.path.exists(local_path(path))


def download_command(repo_id: str, repo_type: str = "model") -> str:
    """The shell command that puts `repo_id` (a model, or a `repo_type="dataset"`) into the local cache
    (huggingface_hub's `hf` CLI; its older `huggingface-cli` is gone from the huggingface_hub megarl installs)."""
    return f"hf download {repo_id}" + ("" if repo_type == "model" else f" --repo-type {repo_type}")


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The local snapshot directory of `repo_id` (revision main; a model, or a `repo_type="dataset"`), or
    None when it is not in the cache. Nothing is downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError):  # not cached (or incomplete); not a valid id (HFValidationError)
        return None


def missing_from_cache(key: str, repo_id: str) -> Problem:
    """The problem of a hub id that is not in the local cache."""
    from huggingface_hub import constants

    return Problem(
        key,
        repo_id,
        f"a hub id that is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), "
        "and megarl never downloads at run time",
        f"download it first: `{download_command(repo_id)}` (HF_HUB_CACHE picks the cache), or set {key} "
        "to a local checkpoint directory",
    )


def hub_values(config: Config) -> dict[str, str]:
    """The settings of `config` that hold hub ids, by key."""
    values = {
        "model.path": config.model.path,
        "model.tokenizer_path": config.model.tokenizer_path,
        "reward.reward_model": config.reward.reward_model,
    }
    return {key: value for key, value in values.items() if value and is_hub_id(value)}


def resolve_hub_ids(config: Config) -> Config:
    """`config` with every hub id replaced by its local snapshot directory (what the workers are
    handed). Raises `ConfigError` naming each id that is not in the local cache."""
    found = {key: cached_snapshot(repo_id) for key, repo_id in hub_values(config).items()}
    missing = [missing_from_cache(key, hub_values(config)[key]) for key, path in found.items() if path is None]
    if missing:
        raise ConfigError(missing)
    local = {key: str(path) for key, path in found.items()}
    model = replace(
        config.model,
        path=local.get("model.path", config.model.path),
        tokenizer_path=local.get("model.tokenizer_path", config.model.tokenizer_path),
    )
    reward = replace(config.reward, reward_model=local.get("reward.reward_model", config.reward.reward_model))
    return replace(config, model=model, reward=reward)
