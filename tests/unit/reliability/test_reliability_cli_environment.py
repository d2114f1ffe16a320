"""The smaller cases of issue 33 (item 12): each used to end in a traceback. Bad input ends with one line
and exit 2, before anything is allocated or written; what the machine refuses (a closed pipe, a full
device, a path the kernel will not write) ends any command with one line naming it and exit 1
(`megarl.cli.main`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from megarl.cli.main import main
from megarl.models.tiny import make_tiny_model

REPO = Path(__file__).resolve().parents[3]

ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """`megarl ARGV...` in this process: (exit code, stdout, stderr), asserting one problem line on stderr
    (validate's report has a count above it and a note below), no traceback and no process left."""
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    problems = [line for line in lines if line.startswith("error: ")] if argv[0] == "validate" else lines
    assert len(problems) == 1 and "Traceback" not in captured.err, captured.err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
    return code, captured.out, captured.err


def run_dir_with(tmp_path: Path, *records) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


CASES = [
    # (id, argv ({tmp} = the test's directory), exit code, words of the one line)
    (
        "validate-dev-zero",
        ["validate", "/dev/zero"],
        2,
        "error: /dev/zero = null: holds more than 1 MiB, so it is no recipe",
    ),
    ("train-dev-zero", ["train", "/dev/zero"], 2, "megarl train: /dev/zero = null: holds more than 1 MiB"),
    (
        "init-tiny-model-enormous",
        [
            "init-tiny-model",
            "--out",
            "{tmp}/big",
            "--hidden-size",
            "1000000",
            "--num-heads",
            "1000",
            "--num-kv-heads",
            "1000",
            "--num-layers",
            "1000",
        ],
        2,
        "megarl init-tiny-model: error: --hidden-size 1000000, --num-layers 1000, --intermediate-size 256 make 4e+15 "
        "parameters, 2.98e+07 GiB to build and write in float32, more than the ",
    ),
    (
        "plot-string-values",
        ["plot", "{tmp}/strings"],
        2,
        "megarl plot: {tmp}/strings/metrics.jsonl: step 1: reward/mean = 'high' is a str, not a number",
    ),
    (
        "plot-record-not-an-object",
        ["plot", "{tmp}/list"],
        2,
        "megarl plot: {tmp}/list/metrics.jsonl: record 1 is a JSON list, not an object of metrics",
    ),
    (
        "plot-record-without-step",
        ["plot", "{tmp}/no_step"],
        2,
        'megarl plot: {tmp}/no_step/metrics.jsonl: record 1 has no integer "step" (step = None)',
    ),
    (
        "plot-into-a-missing-directory",
        ["plot", "{tmp}/good", "--out", "{tmp}/missing/curves.png"],
        2,
        "megarl plot: --out {tmp}/missing/curves.png: the directory {tmp}/missing does not exist",
    ),
    (
        "plot-onto-a-full-device",
        ["plot", "{tmp}/good", "--out", "/dev/full"],
        1,
        "megarl plot: failed: [Errno 28] No space left on device; fix: check the machine's resources",
    ),
    (
        "bench-json-through-a-file",
        ["bench", "sync", "--json", "{tmp}/a_file/result.json"],
        2,
        "megarl bench: --json {tmp}/a_file/result.json: {tmp}/a_file is a file, so no directory can be made there",
    ),
    ("bench-json-a-directory", ["bench", "sync", "--json", "{tmp}"], 2, "megarl bench: --json {tmp} is a directory"),
    # Root passes the permission check, and the kernel refuses the write (exit 1); anyone else is refused at the check.
    (
        "convert-out-in-sys",
        ["convert", "hf-to-mcore", "--hf", "{model}", "--out", "/sys/kernel/megarl-model"],
        1 if ROOT else 2,
        "cannot use /sys/kernel/.megarl-model.tmp-" if ROOT else "--out /sys/kernel/megarl-model",
    ),
]


@pytest.mark.parametrize("argv, code, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_line_and_the_exit_code(tmp_path, model_dir, capsys, argv, code, message):
    run_dir_with(tmp_path, {"step": 1, "reward/mean": "high"}).rename(tmp_path / "strings")
    run_dir_with(tmp_path, [1, 2]).rename(tmp_path / "list")
    run_dir_with(tmp_path, {"reward/mean": 1.0}).rename(tmp_path / "no_step")
    run_dir_with(tmp_path, {"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.7}).rename(tmp_path / "good")
    (tmp_path / "a_file").write_text("")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    fill = {"{tmp}": str(tmp_path), "{model}": str(model_dir)}
    argv = [fill.get(part, part) if part in fill else _fill(part, fill) for part in argv]
    got, _, err = run_cli(capsys, argv)
    assert got == code and _fill(message, fill) in err, err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written, nothing half-written


def _fill(text: str, fill: dict[str, str]) -> str:
    for key, value in fill.items():
        text = text.replace(key, value)
    return text


def test_a_reader_that_closes_the_pipe_ends_validate_with_one_line():
    """`megarl validate CONFIG | head -1`: the reader is gone before the output comes (closed here at once,
    while megarl still imports): exit 1, one line, no traceback (nor Python's 'Exception ignored')."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("megarl")),
            "validate",
            str(REPO / "configs" / "quickstart.yaml"),
            "--no-file-checks",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=120) == 1
    assert err == (
        "megarl validate: the output's reader closed the pipe (e.g. `| head`); the rest of the output was dropped\n"
    )
