"""SIGTERM to the long-running subcommands besides `megarl train` (issue 33, items 7 and 11): `megarl sft`
mid-training, `megarl convert` and `megarl bench` while their ranks run end within seconds with one line (what was
stopped, that nothing was written), exit 143, no traceback, no process of theirs left (Ray's included)
and no output or temporary directory. (SIGHUP to `megarl train`: test_stop_signals.py.)"""

import json
import random
import signal
from pathlib import Path

import psutil
import pytest
from process_testing import spawned_ranks
from reliability_job import Job

from megarl.models.tiny import make_tiny_model
from megarl.rewards.tasks import calc_tool_demo_rows

pytestmark = pytest.mark.slow  # whole commands with a signal sent: `-m "not slow"` leaves them out
REPO = Path(__file__).resolve().parents[3]
END_BOUND_S = 60.0


def rank_count(job: Job) -> int:
    """The job's spawned ranks (`megarl.parallel.spawn`: the children of its fork server)."""
    return len(spawned_ranks(psutil.Process(job.process.pid)))


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tool-model") / "tiny", tool_tokens=True)


def test_sigterm_ends_sft_mid_training(tool_model, tmp_path, jobs):
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps(row) + "\n" for row in calc_tool_demo_rows(64, random.Random(0))))
    out = tmp_path / "out"
    job = Job.launch(
        [
            "sft",
            str(REPO / "configs" / "sft_tiny.yaml"),
            f"model.path={tool_model}",
            f"data.train_files=[{demos}]",
            f"train.output_dir={out}",
            "train.epochs=100",
            "train.total_steps=400",
        ],
        tmp_path,
        tmp_path / "run",
    )
    jobs.append(job)
    job.wait_for(lambda: "sft step 2/400" in job.output(), "sft step 2")
    job.descendants()  # note the job's processes, to check they are gone at the end
    job.process.send_signal(signal.SIGTERM)

    assert job.wait(END_BOUND_S) == 143
    output = job.output()
    lines = [line for line in output.splitlines() if line.startswith("megarl sft: stopped by")]
    assert len(lines) == 1 and lines[0].startswith("megarl sft: stopped by SIGTERM during step "), output[-3000:]
    assert lines[0].endswith(f"; nothing was exported to {out}")
    assert "Traceback" not in output, output[-3000:]
    assert job.leftovers() == []
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_sigterm_ends_convert_and_its_ranks(tool_model, tmp_path, jobs):
    out = tmp_path / "mcore"
    job = Job.launch(
        ["convert", "hf-to-mcore", "--hf", str(tool_model), "--out", str(out), "--tp", "2"], tmp_path, tmp_path / "run"
    )
    jobs.append(job)
    job.wait_for(lambda: rank_count(job) >= 2, "the two ranks started")
    job.process.send_signal(signal.SIGTERM)

    assert job.wait(END_BOUND_S) == 143
    output = job.output()
    assert output.strip().splitlines()[-1] == (
        f"megarl convert hf-to-mcore: stopped by SIGTERM; nothing was written to {out}"
    ), output[-3000:]
    assert "Traceback" not in output
    assert job.leftovers() == []
    assert not out.exists() and not list(tmp_path.glob(".mcore.tmp-*"))


def test_sigterm_ends_bench_and_its_ranks(tmp_path, jobs):
    out = tmp_path / "sync.json"
    job = Job.launch(["bench", "sync", "--smoke", "--json", str(out)], tmp_path, tmp_path / "run")
    jobs.append(job)
    job.wait_for(lambda: rank_count(job) >= 2, "the benchmark's ranks started")
    job.process.send_signal(signal.SIGTERM)

    assert job.wait(END_BOUND_S) == 143
    output = job.output()
    assert output.strip().splitlines()[-1] == f"megarl bench sync: stopped by SIGTERM; nothing was written to {out}", (
        output[-3000:]
    )
    assert "Traceback" not in output
    assert job.leftovers() == []
    assert not out.exists()
