"""Bad configs and bad data end `megarl train` (not only `megarl validate`) at start-up: exit 2, one line
per problem naming the key (or the file and row), each printed once, no traceback, nothing written,
no process and no Ray started.

The catalogue of bad configs through `megarl validate` is tests/unit/config/test_config_catalogue.py;
the data loader's own table of errors is tests/unit/data/. Here: the issue-8 cases through both
commands, and bad data and bad weights (which `validate` does not read) through `megarl train`.
"""

import bz2
import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from megarl.cli.main import main

REPO = Path(__file__).resolve().parents[3]

BAD_CONFIGS = [
    # (id, overrides, key named by the error line, words of the message)
    (
        "colocated-rollout-tp-does-not-fit",
        ["rollout.tensor_model_parallel_size=4"],
        "rollout.tensor_model_parallel_size",
        "does not divide the 2 GPUs",
    ),
    ("critic-on-grpo", ["critic.enable=true"], "critic.enable", "grpo is critic-free"),
    (
        "reward-module-missing",
        ["reward.function=no_such_package.rewards:score"],
        "reward.function",
        "cannot be imported",
    ),
    ("reward-module-does-not-parse", ["reward.function=broken_reward:score"], "reward.function", "cannot be parsed"),
    ("dataset-missing", ["data.train_files=[{tmp}/missing.jsonl]"], "data.train_files[0]", "file does not exist"),
    (
        "checkpoint-dir-not-writable",
        ["checkpoint.dir={tmp}/data/train.jsonl/ckpt"],
        "checkpoint.dir",
        "no directory can be made there",
    ),
    (
        "sync-threshold-negative",
        ["rollout.sync.logprob_gap_threshold=-1"],
        "rollout.sync.logprob_gap_threshold",
        "must be > 0",
    ),
    (
        "tokenizer-without-vocabulary",
        ["model.tokenizer_path={tmp}/data"],
        "model.tokenizer_path",
        "holds no tokenizer vocabulary",
    ),
    # issue 18, item 9: refused before Ray and vLLM start, not after
    (
        "resume-not-a-checkpoint",
        ["checkpoint.resume={tmp}/data"],
        "checkpoint.resume",
        "not a checkpoint: {tmp}/data is not a complete megarl checkpoint: manifest.json is missing",
    ),
    (
        "experiment-name-escapes-output-dir",
        ["trainer.experiment_name=.."],
        "trainer.experiment_name",
        "the run directory would land outside trainer.output_dir",
    ),
]

BAD_DATA = [
    # (id, train.jsonl text or bytes, words the error must contain ({file} = the file's path))
    ("corrupt-json-line", '{"prompt": "abc", "answer": "a"}\n{"prompt": "ab\n', "{file}:2: not valid JSON"),
    ("json-array-row", '{"prompt": "abc", "answer": "a"}\n[1, 2]\n', "{file}:2: a JSON list where a JSON object"),
    ("no-rows", "\n\n", "{file}: the file holds no rows"),
    ("no-prompt-column", '{"question": "abc", "answer": "a"}\n', "{file}: no row has the column 'prompt'"),
    (
        "every-row-empty",
        '{"prompt": "  ", "answer": "a"}\n{"prompt": "", "answer": "b"}\n',
        "no usable prompt in {file}",
    ),
    ("chat-messages-without-template", '{"prompt": [{"role": "user", "content": "abc"}], "answer": "a"}\n', "{file}"),
    (
        "fewer-prompts-than-a-batch",
        '{"prompt": "abc", "answer": "a"}\n',
        "data.train_batch_size 16 is larger than the 1",
    ),
    # Text saved by an editor in another encoding: named, with the command that converts it (issue 18, item 10).
    (
        "utf16-with-bom",
        '{"prompt": "abc", "answer": "a"}\n'.encode("utf-16"),
        "{file}: the file is UTF-16-encoded text, megarl reads UTF-8 JSONL; convert it, e.g. iconv -f UTF-16 -t UTF-8 {file}",
    ),
    (
        "utf16le-without-bom",
        '{"prompt": "abc", "answer": "a"}\n'.encode("utf-16-le"),
        "{file}: the file is UTF-16LE-encoded text",
    ),
    ("utf32-with-bom", '{"prompt": "abc", "answer": "a"}\n'.encode("utf-32"), "iconv -f UTF-32 -t UTF-8 {file}"),
    # A compressed file named .jsonl: every line used to be skipped as `undecodable`, naming no cause.
    (
        "gzip-named-jsonl",
        gzip.compress(b'{"prompt": "abc", "answer": "a"}\n'),
        "{file}: the file is gzip-compressed, megarl reads plain UTF-8 JSONL; decompress it, e.g. gunzip -c {file} >",
    ),
    (
        "bzip2-named-jsonl",
        bz2.compress(b'{"prompt": "abc", "answer": "a"}\n'),
        "{file}: the file is bzip2-compressed, megarl reads plain UTF-8 JSONL; decompress it, e.g. bunzip2 -c {file} >",
    ),
]

BAD_WEIGHTS = [
    # (id, change to the model's tensors (a function of them), words of the one-line error): each used to pass
    # validation and start Ray and vLLM before the workers failed on the weights.
    (
        "missing-tensor",
        lambda w: {k: v for k, v in w.items() if k != "model.layers.1.mlp.down_proj.weight"},
        "tensor 'model.layers.1.mlp.down_proj.weight' is missing",
    ),
    (
        "wrong-shape",
        lambda w: {**w, "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 128)},
        "tensor 'model.layers.0.self_attn.q_proj.weight' has shape [64, 128], config.json implies [128, 128]",
    ),
    (
        "integer-dtype",
        lambda w: {k: v.to(torch.int8) if k.endswith("q_proj.weight") else v for k, v in w.items()},
        "tensor 'model.layers.0.self_attn.q_proj.weight' has dtype I8, not a floating-point type (a quantized "
        "checkpoint?)",
    ),
    (
        "untied-without-lm-head",
        lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"},
        "tensor 'lm_head.weight' is missing",
    ),
]


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under `directory`, with size and mtime for files. A directory's mtime is left out: the run
    directory's lock (megarl.run_lock) is made and removed again when a run stops at start-up."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (0, 0)
        for p in [directory, *directory.rglob("*")]
        if "__pycache__" not in p.parts
    }


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`megarl ARGV...` in this process, asserting it started no process and no Ray."""
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main(list(argv))
    captured = capsys.readouterr()
    assert not ray.is_initialized(), f"megarl {argv[0]} started Ray"
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children, f"megarl {argv[0]} started a process"
    return code, captured.out, captured.err


def problem_lines(command: str, err: str) -> list[str]:
    """Lines that report one problem each: `megarl train: <key> = ...` or `error: <key> = ...`."""
    prefix = "megarl train: " if command == "train" else "error: "
    return [line[len(prefix) :] for line in err.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("command", ["train", "validate"])
@pytest.mark.parametrize("overrides, key, message", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_exits_2_before_starting_anything(workdir, capsys, command, overrides, key, message):
    before = snapshot(workdir)
    code, out, err = run_cli(capsys, command, "recipe.yaml", *(o.replace("{tmp}", str(workdir)) for o in overrides))
    assert code == 2
    assert out == ""
    lines = problem_lines(command, err)
    message = message.replace("{tmp}", str(workdir))
    assert [line for line in lines if line.startswith(f"{key} = ") and message in line], err
    assert len(lines) == len(set(lines)), f"a problem was printed twice:\n{err}"
    assert "Traceback" not in err
    assert snapshot(workdir) == before


@pytest.mark.parametrize("text, message", [c[1:] for c in BAD_DATA], ids=[c[0] for c in BAD_DATA])
def test_bad_data_ends_train_at_startup_naming_file_and_row(workdir, capsys, ray_refused, text, message):
    # Refused Ray: the data is read before the trainer uses Ray, so each case skips the early start's node
    # (seconds each); the case below keeps the real early start.
    assert_bad_data_ends_train(workdir, capsys, text, message)


def test_bad_data_ends_train_and_the_early_ray_start_it_began(workdir, capsys):
    """The real `megarl train`: its Ray node is starting while the data loads; the data error ends the run
    and stops that node (`run_cli`: no Ray, no process left)."""
    _, text, message = BAD_DATA[0]
    assert_bad_data_ends_train(workdir, capsys, text, message)


def assert_bad_data_ends_train(workdir, capsys, text, message) -> None:
    data = workdir / "data" / "train.jsonl"
    data.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = snapshot(workdir)
    code, _out, err = run_cli(capsys, "train", "recipe.yaml")
    assert code == 2
    lines = problem_lines("train", err)
    assert len(lines) == 1 and message.format(file=data) in lines[0], err
    assert "Traceback" not in err
    assert snapshot(workdir) == before


@pytest.mark.parametrize("change, message", [c[1:] for c in BAD_WEIGHTS], ids=[c[0] for c in BAD_WEIGHTS])
def test_weights_that_do_not_match_config_json_end_train_at_startup(
    workdir, model_dir, capsys, ray_refused, change, message
):
    model = workdir / "model"
    shutil.copytree(model_dir, model)
    save_file(change(load_file(model / "model.safetensors")), model / "model.safetensors")
    before = snapshot(workdir)
    code, out, err = run_cli(capsys, "train", "recipe.yaml", f"model.path={model}")
    assert (code, out) == (2, "")
    (line,) = problem_lines("train", err)
    assert line.startswith(f"model.path = '{model}': the weights do not match config.json: ") and message in line, err
    assert "Traceback" not in err
    assert snapshot(workdir) == before


def test_a_model_without_safetensors_ends_train_at_startup(workdir, model_dir, capsys, ray_refused):
    model = workdir / "model"
    shutil.copytree(model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    code, _, err = run_cli(capsys, "train", "recipe.yaml", f"model.path={model}")
    assert code == 2
    assert problem_lines("train", err) == [
        f"model.path = '{model}': the weights do not match config.json: {model}: no model.safetensors or "
        "model.safetensors.index.json (megarl reads safetensors checkpoints only); fix: restore the checkpoint's "
        "files (or download it again), or point model.path at a complete checkpoint"
    ], err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into read-only directories")
def test_read_only_checkpoint_dir_exits_2_from_train(workdir, capsys):
    locked = workdir / "locked"
    locked.mkdir(mode=0o555)
    code, _, err = run_cli(capsys, "train", "recipe.yaml", f"checkpoint.dir={locked}/ckpt")
    assert code == 2
    assert any(
        line.startswith("checkpoint.dir = ") and "is not writable" in line for line in problem_lines("train", err)
    )


def test_train_process_reports_every_problem_once_and_starts_no_ray(workdir):
    """The real `megarl train` process with all the issue-8 cases at once: exit 2, one line each,
    and its Ray temp dir (RAY_TMPDIR, inside the watched directory) stays empty."""
    ray_tmp = workdir / "ray-tmp"
    ray_tmp.mkdir()
    overrides = [o.replace("{tmp}", str(workdir)) for case in BAD_CONFIGS for o in case[1]]
    before = snapshot(workdir)
    # REPO on the path: the process runs this checkout's megarl, whichever one the venv was installed from.
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": os.pathsep.join([str(workdir), str(REPO)])}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [str(Path(sys.executable).with_name("megarl")), "train", "recipe.yaml", *overrides],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = problem_lines("train", result.stderr)
    assert len(lines) == len(set(lines))
    expected = {key: message for _, _, key, message in BAD_CONFIGS}  # a key given twice: the last value counts
    for key, message in expected.items():
        message = message.replace("{tmp}", str(workdir))
        assert [line for line in lines if line.startswith(f"{key} = ") and message in line], (key, result.stderr)
    assert "Traceback" not in result.stderr
    assert snapshot(workdir) == before


def test_reward_module_failing_at_import_exits_2_before_ray(workdir, capsys, ray_refused):
    """Validation only parses the module (it never runs user code); the trainer's reward workers
    import it before Ray starts."""
    (workdir / "raising_reward.py").write_text(
        "import no_such_dependency\n\ndef score(prompts, responses, **c):\n    return [0.0] * len(responses)\n"
    )
    code, _, err = run_cli(capsys, "train", "recipe.yaml", "reward.function=raising_reward:score")
    assert code == 2
    assert any(
        line.startswith("reward.function") and "no_such_dependency" in line for line in problem_lines("train", err)
    )
