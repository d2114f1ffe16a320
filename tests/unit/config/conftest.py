"""Fixtures of the config tests: a working directory with a tiny model, data and a valid base recipe."""

import pytest
import yaml
from config_testing import write_model


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory with a tiny model, a training file and a valid recipe `base.yaml`.

    Layout of the recipe: 4 GPUs colocated; actor TP 2 (DP 2), reference TP 1 (DP 4), rollout TP 1
    (4 engines); 8 prompts × 4 samples; checkpoints and outputs under the working directory.
    """
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    recipe = {
        "model": {"path": str(tmp_path / "model"), "dtype": "float32"},
        "actor": {
            "parallel": {"tensor_model_parallel_size": 2},
            "micro_batch_size_per_gpu": 4,
            "ppo_mini_batch_size": 4,
            "use_kl_loss": True,
        },
        "ref": {"micro_batch_size_per_gpu": 4},
        "rollout": {"n": 4, "max_new_tokens": 16},
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "train_batch_size": 8, "max_prompt_length": 64},
        "trainer": {"device": "cpu"},
        "placement": {"gpus_per_node": 4},
    }
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path
