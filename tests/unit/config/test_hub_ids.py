"""Hub ids: validated against the local HF cache, resolved once to the snapshot directory, never downloaded.

The cache is made in the test (hf_cache_testing) and checked with huggingface_hub's own readers.
"""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from config_testing import error_lines, run_validate
from hf_cache_testing import COMMIT, put_in_cache, use_cache
from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache

from megarl.config.hub import resolve_hub_ids
from megarl.config.loader import load_config
from megarl.config.problems import ConfigError
from megarl.models.tiny import make_tiny_model, make_tiny_reward_model

MODEL_ID = "megarl-test/tiny-qwen2"
REWARD_ID = "megarl-test/tiny-rm"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return make_tiny_model(root / "policy"), make_tiny_reward_model(root / "rm")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny_models) -> dict[str, Path]:
    """A local HF cache holding the tiny policy and reward model; returns their snapshot directories."""
    cache = tmp_path / "hf-cache"
    use_cache(monkeypatch, cache)
    policy, reward = tiny_models
    return {MODEL_ID: put_in_cache(policy, MODEL_ID, cache), REWARD_ID: put_in_cache(reward, REWARD_ID, cache)}


def test_the_test_cache_is_what_huggingface_hub_reads(hf_cache, tiny_models, tmp_path):
    info = scan_cache_dir(tmp_path / "hf-cache")
    assert info.warnings == []
    assert {repo.repo_id for repo in info.repos} == {MODEL_ID, REWARD_ID}
    repo = next(repo for repo in info.repos if repo.repo_id == MODEL_ID)
    (revision,) = repo.revisions
    assert (revision.commit_hash, set(revision.refs)) == (COMMIT, {"main"})
    assert {f.file_name for f in revision.files} == {p.name for p in tiny_models[0].iterdir()}
    assert Path(snapshot_download(MODEL_ID, local_files_only=True)) == hf_cache[MODEL_ID]
    assert Path(try_to_load_from_cache(MODEL_ID, "config.json")) == hf_cache[MODEL_ID] / "config.json"


def test_hub_ids_in_the_cache_validate_and_resolve_to_their_snapshots(workdir, hf_cache, capsys):
    overrides = [f"model.path={MODEL_ID}", f"model.tokenizer_path={MODEL_ID}", f"reward.reward_model={REWARD_ID}"]
    code, out, err = run_validate(capsys, "base.yaml", *overrides)
    assert (code, err) == (0, "")
    assert f"from {hf_cache[MODEL_ID] / 'config.json'}" in out  # the shape came from the cached config.json
    resolved = resolve_hub_ids(load_config("base.yaml", overrides))
    assert resolved.model.path == resolved.model.tokenizer_path == str(hf_cache[MODEL_ID])
    assert resolved.reward.reward_model == str(hf_cache[REWARD_ID])


def test_local_directories_are_left_as_they_are(workdir, hf_cache):
    config = load_config("base.yaml")
    assert resolve_hub_ids(config) == config


@pytest.mark.parametrize("key", ["model.path", "model.tokenizer_path", "reward.reward_model"])
def test_a_hub_id_missing_from_the_cache_stops_validation_with_the_download_command(
    workdir, tmp_path, monkeypatch, capsys, key
):
    use_cache(monkeypatch, tmp_path / "empty-cache")
    repo_id = "Qwen/Qwen2.5-0.5B-Instruct"  # in megarl's known-models table: only the cache is missing
    code, _, err = run_validate(capsys, "base.yaml", f"{key}={repo_id}")
    assert code == 2
    (line,) = [line for line in error_lines(err) if line.startswith(f"error: {key} ")]
    assert "not in the local Hugging Face cache" in line and f"`hf download {repo_id}`" in line
    with pytest.raises(ConfigError, match=f"hf download {repo_id}"):
        resolve_hub_ids(load_config("base.yaml", [f"{key}={repo_id}"]))
    # Without file checks the recipe validates for another machine (the model's shape from the known table).
    code, _, err = run_validate(capsys, "--no-file-checks", "base.yaml", f"{key}={repo_id}")
    assert not [line for line in error_lines(err) if line.startswith(f"error: {key} ")]


def test_the_download_command_is_the_installed_huggingface_hub_cli():
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="hf")
    assert script.dist.name == "huggingface_hub"
    help_text = subprocess.run(
        [Path(sys.executable).parent / "hf", "download", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "REPO_ID" in help_text.upper()
