"""A local Hugging Face cache made in a test: a model (or dataset) directory filed under a hub id the way
`hf download` leaves it (huggingface_hub/file_download.py, `hf_hub_download` → `_create_symlink`;
a dataset's folder is `datasets--<org>--<name>`):

    <cache>/models--<org>--<name>/blobs/<sha256 of the file>
    <cache>/models--<org>--<name>/snapshots/<commit>/<file>  -> ../../blobs/<sha256>  (relative symlink)
    <cache>/models--<org>--<name>/refs/main                  the commit hash

The folder name comes from huggingface_hub's own `repo_folder_name`; `test_hub_ids.py` checks the
result with huggingface_hub's `scan_cache_dir` and `snapshot_download(local_files_only=True)`.
"""

import hashlib
import os
import shutil
from pathlib import Path

from huggingface_hub.file_download import repo_folder_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(model_dir: Path, repo_id: str, cache: Path, commit: str = COMMIT, repo_type: str = "model") -> Path:
    """File every file of `model_dir` under `repo_id` (a `repo_type` repository) in `cache`; returns the
    snapshot directory."""
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for source in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, blob)
        pointer = snapshot / source.relative_to(model_dir)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def use_cache(monkeypatch, cache: Path) -> None:
    """Point HF_HUB_CACHE at `cache` for this process: the variable, and huggingface_hub's constant
    that it read when it was first imported (huggingface_hub/constants.py `HF_HUB_CACHE`)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
