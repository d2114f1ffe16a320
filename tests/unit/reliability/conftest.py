"""Fixtures of the start-up checks of `megarl train`."""

import json
from pathlib import Path

import pytest
import yaml

from megarl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[3]


class _RayWouldStart(Exception):
    pass


@pytest.fixture
def ray_refused(monkeypatch):
    """The trainer's `init_ray` raises: a start-up check that lets a bad input through fails the test at
    once instead of starting Ray and vLLM. (`megarl train`'s early start is a no-op here: these checks
    come before the trainer uses Ray, whether or not its node is starting meanwhile.
    tests/unit/reliability/test_reliability_cli_inputs.py keeps one bad-data case with the real early start.)"""
    import megarl.orchestration.cluster as cluster
    import megarl.trainer.trainer as trainer_module

    def refuse(*args, **kwargs):
        raise _RayWouldStart

    monkeypatch.setattr(trainer_module, "init_ray", refuse)
    monkeypatch.setattr(cluster, "start_ray_early", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def workdir(tmp_path, model_dir, monkeypatch):
    """A valid quickstart-shaped recipe (2 processes, actor TP 2, 2 colocated engines) in `tmp_path`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "data").mkdir()
    rows = [{"prompt": "abc"[: 1 + i % 3] + "de", "answer": "a"} for i in range(32)]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "broken_reward.py").write_text("def score(prompts, responses:\n    return []\n")
    recipe = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    recipe["model"]["path"] = str(model_dir)
    recipe["data"] |= {"train_files": [str(tmp_path / "data" / "train.jsonl")], "val_files": []}
    recipe["trainer"] |= {"test_freq": 0, "output_dir": str(tmp_path / "out")}
    recipe["checkpoint"]["dir"] = str(tmp_path / "ckpt")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path
