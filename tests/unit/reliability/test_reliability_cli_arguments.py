"""Bad command-line arguments and bad model files end `megarl check-sync`, `convert`, `validate`,
`init-tiny-model` and `make-data` with one line naming the flag or file and the value: exit 2, no
traceback, nothing written and no process started (issue 18, items 5, 7 and 8).

Bad config.json files through `megarl validate` are in the config catalogue
(tests/unit/config/test_config_catalogue.py); here they go through `convert` and `check-sync`.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.cli.main import main
from megarl.models.tiny import make_tiny_model

BAD_NUMBERS = [
    # (command line before the flag, flag, value)
    *[
        (["check-sync", "--model", "{model}"], "--bucket-mb", value)
        for value in ("inf", "nan", "0", "-1", "1e300", "abc")
    ],
    *[(["check-sync", "--model", "{model}"], "--threshold", value) for value in ("inf", "-inf", "nan", "0")],
    *[(["validate", "recipe.yaml"], "--gpu-memory-gib", value) for value in ("inf", "nan", "0", "-80", "eighty")],
]

BAD_CONFIG_JSON = [
    # (id, change to the tiny model's config.json (a function of it), words of the one-line error)
    ("zero-heads", lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer"),
    (
        "heads-as-text",
        lambda c: {**c, "num_attention_heads": "4"},
        "num_attention_heads='4' must be a positive integer",
    ),
    ("json-list", lambda c: [c], "config.json: a JSON list where an object of settings belongs"),
    (
        "linear-rope-without-factor",
        lambda c: {**c, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
        "required key 'rope_parameters.factor' is missing",
    ),
    (
        "legacy-linear-rope-without-factor",
        lambda c: {
            **{k: v for k, v in c.items() if k != "rope_parameters"},
            "rope_theta": 1e4,
            "rope_scaling": {"type": "linear"},
        },
        "required key 'rope_scaling.factor' is missing",
    ),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in [directory, *directory.rglob("*")]
    }


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """`megarl ARGV...` in this process (argparse's own exit included), asserting it started no process."""
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children, f"megarl {argv[0]} started a process"
    return code, captured.out, captured.err


def copy_with_config(model_dir: Path, destination: Path, change) -> Path:
    shutil.copytree(model_dir, destination)
    config = destination / "config.json"
    config.write_text(json.dumps(change(json.loads(config.read_text()))))
    return destination


@pytest.mark.parametrize("argv, flag, value", BAD_NUMBERS, ids=[f"{a[0]}{f}={v}" for a, f, v in BAD_NUMBERS])
def test_bad_number_stops_argument_parsing(model_dir, tmp_path, capsys, monkeypatch, argv, flag, value):
    monkeypatch.chdir(tmp_path)
    argv = [arg.format(model=model_dir) for arg in argv] + [f"{flag}={value}"]
    code, out, err = run_cli(capsys, argv)
    assert (code, out) == (2, "")
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert f"argument {flag}: '{value}'" in line and ("finite number above 0" in line or "not a number" in line), err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_check_sync_process_with_an_infinite_bucket_exits_at_once(model_dir, tmp_path):
    """The real process: once accepted, `--bucket-mb inf` hung for minutes in the spawned ranks."""
    megarl = str(Path(sys.executable).with_name("megarl"))
    result = subprocess.run(
        [megarl, "check-sync", "--model", str(model_dir), "--bucket-mb", "inf"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "argument --bucket-mb: 'inf': must be a finite number above 0 and at most 1048576" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["init-tiny-model", "make-data"])
def test_non_empty_out_is_refused_without_overwrite(tmp_path, capsys, command):
    out = tmp_path / "real-model"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the weights of a real model")
    (out / "train.jsonl").write_text('{"prompt": "a real dataset", "answer": "a"}\n')
    argv = [command, "--out", str(out)] + (["--task", "repeat_first_char"] if command == "make-data" else [])
    before = snapshot(tmp_path)
    code, out_text, err = run_cli(capsys, argv)
    assert (code, out_text) == (2, "")
    assert err == (
        f"megarl {command}: error: --out {out} is not empty (holds model.safetensors, train.jsonl): choose "
        "an empty or new directory, or pass --overwrite to replace the files this command writes there\n"
    )
    assert snapshot(tmp_path) == before
    code, _, err = run_cli(capsys, argv + ["--overwrite"])
    assert (code, err) == (0, "")
    assert (out / "config.json" if command == "init-tiny-model" else out / "val.jsonl").is_file()


@pytest.mark.parametrize("command", ["init-tiny-model", "make-data"])
def test_empty_out_is_written_without_overwrite(tmp_path, capsys, command):
    out = tmp_path / "empty"
    out.mkdir()
    argv = [command, "--out", str(out)] + (["--task", "repeat_first_char"] if command == "make-data" else [])
    code, _, err = run_cli(capsys, argv)
    assert (code, err) == (0, "")


@pytest.mark.parametrize(
    "argv",
    [["init-tiny-model"], ["make-data", "--task", "repeat_first_char"], ["convert", "hf-to-mcore", "--hf", "{model}"]],
    ids=lambda argv: argv[0],
)
def test_out_through_a_file_is_named(model_dir, tmp_path, capsys, argv):
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    out = tmp_path / "notes.txt" / "out"
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, [arg.format(model=model_dir) for arg in argv] + ["--out", str(out)])
    assert code == 2
    assert err.endswith(
        f"error: --out {out}: {tmp_path / 'notes.txt'} is a file, so no directory can be made there; "
        "choose a directory path that does not go through a file\n"
    ), err
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into read-only directories")
def test_convert_into_a_read_only_directory_is_named(model_dir, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    code, _, err = run_cli(capsys, ["convert", "hf-to-mcore", "--hf", str(model_dir), "--out", str(locked / "mcore")])
    assert code == 2
    assert f"error: --out {locked / 'mcore'}: {locked} (the nearest existing parent" in err and "not writable" in err
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("command", ["convert", "check-sync"])
@pytest.mark.parametrize("change, message", [c[1:] for c in BAD_CONFIG_JSON], ids=[c[0] for c in BAD_CONFIG_JSON])
def test_bad_config_json_is_one_line(model_dir, tmp_path, capsys, command, change, message):
    bad = copy_with_config(model_dir, tmp_path / "bad-model", change)
    argv = (
        ["convert", "hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "out")]
        if command == "convert"
        else ["check-sync", "--model", str(bad)]
    )
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, argv)
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith(f"megarl {argv[0]}") and "config.json" in line and message in line, err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flag", ["--num-heads", "--num-kv-heads"])
def test_init_tiny_model_with_zero_heads_is_one_line(tmp_path, capsys, flag):
    """Divided by before it was checked: a ZeroDivisionError traceback."""
    code, out, err = run_cli(capsys, ["init-tiny-model", "--out", str(tmp_path / "tiny"), flag, "0"])
    assert (code, out) == (2, "")
    assert err == f"megarl init-tiny-model: error: {flag} must be >= 1, got 0\n"
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_integer_weights(model_dir, tmp_path, capsys):
    """An int8 tensor (as a quantized checkpoint holds) used to be converted without a word."""
    bad = copy_with_config(model_dir, tmp_path / "int8-model", lambda config: config)
    weights = bad / "model.safetensors"
    tensors = load_file(weights)
    save_file(
        {**tensors, "model.layers.1.mlp.up_proj.weight": tensors["model.layers.1.mlp.up_proj.weight"].to(torch.int8)},
        weights,
    )
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "out")])
    assert code == 2
    assert err == (
        f"megarl convert hf-to-mcore: error: {weights}: tensor 'model.layers.1.mlp.up_proj.weight' has dtype "
        "I8, not a floating-point type (a quantized checkpoint?): megarl trains and converts float32, "
        "bfloat16 or float16 weights; use the model's unquantized checkpoint\n"
    )
    assert snapshot(tmp_path) == before


def test_convert_names_a_truncated_safetensors_file(model_dir, tmp_path, capsys):
    bad = copy_with_config(model_dir, tmp_path / "cut-model", lambda config: config)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted download
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-mcore", "--hf", str(bad), "--out", str(tmp_path / "out")])
    assert code == 2
    assert err == (
        f"megarl convert hf-to-mcore: error: {weights} is not a complete safetensors file (Error while "
        "deserializing header: incomplete metadata, file not fully covered): copy or download it again\n"
    )
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--ep", "3"], "expert parallel size 3 does not divide num_experts=8: use an EP size that divides it"),
        (["--ep", "0"], "--ep must be >= 1, got 0"),
        (["--etp", "3"], "expert tensor parallel size 3 does not divide moe_intermediate_size=128"),
    ],
)
def test_convert_names_an_expert_layout_the_model_cannot_be_cut_into(tmp_path, capsys, flags, message):
    moe = make_tiny_model(tmp_path / "moe", "qwen3_moe")
    code, _, err = run_cli(capsys, ["convert", "hf-to-mcore", "--hf", str(moe), "--out", str(tmp_path / "out"), *flags])
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_expert_parallelism_for_a_dense_model(model_dir, tmp_path, capsys):
    code, _, err = run_cli(
        capsys, ["convert", "hf-to-mcore", "--hf", str(model_dir), "--out", str(tmp_path / "out"), "--ep", "2"]
    )
    assert code == 2 and "expert parallel size 2 for a dense model" in err and "expert_model_parallel_size to 1" in err
