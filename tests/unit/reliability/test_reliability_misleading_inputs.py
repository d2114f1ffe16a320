"""Inputs that used to get a misleading message from `convert` and `check-sync` (issue 18, item 10):
a file where a checkpoint directory belongs, and a damaged training checkpoint or a run's checkpoint root given
to `mcore-to-hf` (tests/distributed/checkpoint/test_convert_training_checkpoint.py converts a real one). Each
exits 2 with one line naming the path and what to pass instead, starting no process.

The recipe-level cases (a file as model.path, a directory as a data file, homoglyphs, merge keys,
encodings) are in tests/unit/config/test_config_catalogue.py; UTF-16 data in test_reliability_cli_inputs.py.
"""

import json

import psutil
import pytest

from megarl.cli.main import main

CASES = [
    # (id, argv ({tmp} = the working directory), words of the error line)
    (
        "hf-to-mcore-given-a-weights-file",
        ["convert", "hf-to-mcore", "--hf", "{tmp}/model.safetensors", "--out", "{tmp}/o"],
        "{tmp}/model.safetensors is a file, not a checkpoint directory: pass the directory that holds config.json",
    ),
    (
        "check-sync-given-a-data-file",
        ["check-sync", "--model", "{tmp}/train.jsonl"],
        "{tmp}/train.jsonl is a file, not a checkpoint directory",
    ),
    (
        "hf-to-mcore-given-a-binary-config",
        ["convert", "hf-to-mcore", "--hf", "{tmp}/binary_config", "--out", "{tmp}/o"],
        "{tmp}/binary_config/config.json: not valid UTF-8 JSON",
    ),
    (
        "mcore-to-hf-given-a-file",
        ["convert", "mcore-to-hf", "--ckpt", "{tmp}/model.safetensors", "--out", "{tmp}/o"],
        "{tmp}/model.safetensors is a file, not a directory",
    ),
    (
        "mcore-to-hf-given-a-damaged-training-step",
        ["convert", "mcore-to-hf", "--ckpt", "{tmp}/ckpt/step_00000004", "--out", "{tmp}/o"],
        "{tmp}/ckpt/step_00000004/manifest.json cannot be read as a megarl checkpoint manifest",
    ),
    (
        "mcore-to-hf-given-a-checkpoint-dir",
        ["convert", "mcore-to-hf", "--ckpt", "{tmp}/ckpt", "--out", "{tmp}/o"],
        "{tmp}/ckpt is a checkpoint root (checkpoint.dir), not a checkpoint: pass one of its step directories, e.g. "
        "{tmp}/ckpt/step_00000004",
    ),
    (
        "mcore-to-hf-damaged-metadata",
        ["convert", "mcore-to-hf", "--ckpt", "{tmp}/damaged", "--out", "{tmp}/o"],
        "{tmp}/damaged/megarl_model.json is damaged (",
    ),
]


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "binary_config").mkdir()
    (tmp_path / "binary_config" / "config.json").write_bytes(b"\xff\xd8\xff\xe0 a JPEG, not JSON")
    (tmp_path / "ckpt" / "step_00000004").mkdir(
        parents=True
    )  # a run's checkpoint.dir, one step, its manifest cut short
    (tmp_path / "ckpt" / "step_00000004" / "manifest.json").write_text(json.dumps({"step": 4}))
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "megarl_model.json").write_text('{"format": "megarl-mcore/1", "tp_si')
    return tmp_path


@pytest.mark.parametrize("argv, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_misleading_input_exits_2_naming_the_path(workdir, capsys, argv, message):
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main([arg.replace("{tmp}", str(workdir)) for arg in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message.replace("{tmp}", str(workdir)) in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
    assert not (workdir / "o").exists()
