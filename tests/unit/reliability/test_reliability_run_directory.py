"""One run per run directory (issue 33, item 3): a second `megarl train` or `megarl sft` into a directory
that a live run holds is refused before Ray starts, naming the directory, the holder and the fix; the lock
of a run that died is taken over and named; `megarl sft`'s `train.overwrite: true` replaces only what an
earlier `megarl sft` wrote (its marker), never user files or the run's own data."""

import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from test_reliability_cli_inputs import run_cli

from megarl.config.sft import SFT_MARKER, load_sft_config, validate_sft, write_sft_marker
from megarl.models.tiny import make_tiny_model
from megarl.run_lock import LOCK_NAME, DirectoryLocks

REPO = Path(__file__).resolve().parents[3]

HOLDER = """
import sys
from pathlib import Path
from megarl.run_lock import DirectoryLocks
locks = DirectoryLocks.acquire([("a.setting", Path(sys.argv[1]), Path(sys.argv[2]))], "megarl train other.yaml", "test")
print("locked", flush=True)
sys.stdin.read()
"""
"""A run holding the lock of the directory argv[1] (lock file argv[2]) until its stdin closes."""


@contextmanager
def lock_holder(directory, lock_file):
    """A live process holding the lock; yields it (its pid is the holder's)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), str(lock_file)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "locked\n"
        yield process
    finally:
        process.stdin.close()
        process.wait(timeout=60)


def dead_holder(directory, lock_file) -> int:
    """The pid of a run that took the lock and was killed (SIGKILL: nothing of its own ran after)."""
    with lock_holder(directory, lock_file) as process:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    return process.pid


@pytest.mark.parametrize("setting, directory", [("trainer.output_dir", "out/quickstart"), ("checkpoint.dir", "ckpt")])
def test_a_second_train_into_a_held_directory_is_refused_before_ray(workdir, capsys, ray_refused, setting, directory):
    held = workdir / directory
    held.mkdir(parents=True)
    with lock_holder(held, held / LOCK_NAME) as holder:
        record = (held / LOCK_NAME).read_text()
        code, out, err = run_cli(capsys, "train", "recipe.yaml")
        assert (held / LOCK_NAME).read_text() == record  # the holder's lock and record are left alone
    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"megarl train: {held} ({setting}) is in use by another run: pid {holder.pid} on "
        f"{socket.gethostname()}, started "
    ), err
    assert "(`megarl train other.yaml`); fix: give this run another " + setting in err
    assert err.endswith(f", or stop that run (kill {holder.pid} on {socket.gethostname()})\n"), err


def test_the_stale_lock_of_a_killed_run_is_named_and_taken_over(workdir, capsys, ray_refused):
    run_dir = workdir / "out" / "quickstart"
    run_dir.mkdir(parents=True)
    pid = dead_holder(run_dir, run_dir / LOCK_NAME)
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == pid  # the record a crash leaves behind
    (workdir / "data" / "train.jsonl").write_text("\n")  # the run then stops at its data, lock released
    code, _, err = run_cli(capsys, "train", "recipe.yaml")
    assert code == 2
    assert err.splitlines()[0].startswith(
        f"megarl train: {run_dir} was locked by a run that is no longer running (pid {pid} on "
    ), err
    assert err.splitlines()[0].endswith("(`megarl train other.yaml`)); taking its lock over"), err
    assert "the file holds no rows" in err.splitlines()[1]
    assert sorted(p.name for p in run_dir.iterdir()) == []  # released: the lock file is gone


def test_a_dead_run_holding_two_directories_is_named_once(tmp_path, capsys):
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    pid = dead_holder(run_dir, run_dir / LOCK_NAME)
    (checkpoints / LOCK_NAME).write_bytes((run_dir / LOCK_NAME).read_bytes())  # as the dead run left both
    with DirectoryLocks.acquire(
        [
            ("trainer.output_dir", run_dir, run_dir / LOCK_NAME),
            ("checkpoint.dir", checkpoints, checkpoints / LOCK_NAME),
        ],
        "megarl train x",
        "t",
    ):
        pass
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"t: {run_dir} and {checkpoints} were locked by a run that is no longer running (pid {pid} ")
    assert line.endswith("; taking their locks over")


def test_locks_are_released_and_the_directories_they_made_removed(tmp_path):
    run_dir = tmp_path / "out" / "run"
    with DirectoryLocks.acquire([("trainer.output_dir", run_dir, run_dir / LOCK_NAME)], "megarl train x.yaml", "t"):
        assert json.loads((run_dir / LOCK_NAME).read_text())["command"] == "megarl train x.yaml"
        (tmp_path / "out" / "kept.txt").write_text("written by the run")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["out", "out/kept.txt"]
    with DirectoryLocks.acquire([("trainer.output_dir", run_dir, run_dir / LOCK_NAME)], "megarl train x.yaml", "t"):
        with pytest.raises(Exception, match=f"is in use by another run: pid {os.getpid()} "):
            DirectoryLocks.acquire([("trainer.output_dir", run_dir, run_dir / LOCK_NAME)], "megarl train y", "t")


@pytest.fixture
def sft_workdir(tmp_path, monkeypatch):
    """A tiny model, demos.jsonl and a valid recipe sft.yaml writing `out` (train.overwrite: true)."""
    monkeypatch.chdir(tmp_path)
    make_tiny_model(tmp_path / "model", tool_tokens=True)
    demo = {"messages": [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]}
    (tmp_path / "demos.jsonl").write_text(json.dumps(demo) + "\n")
    recipe = {
        "model": {"path": "model", "dtype": "float32"},
        "data": {"train_files": ["demos.jsonl"]},
        "train": {"batch_size": 1, "device": "cpu", "output_dir": "out", "overwrite": True},
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path


def sft_problems(overrides: list[str]) -> list[str]:
    return [str(problem) for problem in validate_sft(load_sft_config("sft.yaml", overrides))]


def test_sft_overwrite_refuses_a_directory_of_user_files(sft_workdir, capsys):
    out = sft_workdir / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert sft_problems([]) == [
        "train.output_dir = 'out': holds 1 file(s) that `megarl sft` did not write (notes.txt); train.overwrite: "
        f"true replaces only an earlier `megarl sft` output (the files its {SFT_MARKER} lists); fix: choose a new "
        "directory, or move those files out of it"
    ]
    code, out_text, err = run_cli(capsys, "sft", "sft.yaml")
    assert (code, out_text) == (2, "") and "megarl sft: train.output_dir = 'out': holds 1 file(s)" in err
    assert (out / "notes.txt").read_text() == "mine"


def test_sft_overwrite_replaces_only_an_earlier_sft_output(sft_workdir):
    out = sft_workdir / "out"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        (out / name).write_text("an earlier export")
    write_sft_marker(out)
    assert sft_problems([]) == []
    assert sft_problems(["train.overwrite=false"])[0].startswith("train.output_dir = 'out': already holds 3 file(s)")
    (out / "eval.txt").write_text("added by the user after that run")
    assert sft_problems([]) == [
        "train.output_dir = 'out': holds 1 file(s) that `megarl sft` did not write (eval.txt); train.overwrite: "
        f"true replaces only an earlier `megarl sft` output (the files its {SFT_MARKER} lists); fix: choose a new "
        "directory, or move those files out of it"
    ]


def test_sft_overwrite_refuses_a_directory_holding_its_own_data(sft_workdir):
    out = sft_workdir / "out"
    out.mkdir()
    os.replace(sft_workdir / "demos.jsonl", out / "demos.jsonl")
    write_sft_marker(out)  # even a marked directory: the marker would list the data as the export's
    assert sft_problems(["data.train_files=[out/demos.jsonl]"]) == [
        "train.output_dir = 'out': holds this run's training data (out/demos.jsonl), which train.overwrite: true "
        "would delete; fix: write the model to another directory"
    ]


def test_a_second_sft_into_a_held_directory_is_refused_before_ray(sft_workdir, capsys, monkeypatch):
    import megarl.trainer.sft as sft_module

    def no_ray(**kwargs):
        raise AssertionError("Ray started although another run holds train.output_dir")

    monkeypatch.setattr(sft_module, "init_ray", no_ray)
    out = sft_workdir / "out"
    with lock_holder(out, sft_workdir / f".out{LOCK_NAME}") as holder:
        code, _, err = run_cli(capsys, "sft", "sft.yaml")
    assert code == 1
    line = err.splitlines()[-1]
    assert line.startswith(f"megarl sft: {out} (train.output_dir) is in use by another run: pid {holder.pid} on "), err
    assert line.endswith(
        f"fix: give this run another train.output_dir, or stop that run (kill {holder.pid} on {socket.gethostname()})"
    ), err
    assert not out.exists()
