"""scripts/ray_head.sh, submit.sh and stop.sh end to end on this machine: a real Ray head (4 logical CPUs),
real jobs whose exit codes come back through submit.sh, and no Ray process left after stop.sh."""

import json
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from deploy_support import REPO, free_ports

QUICKSTART_JOB = (
    "megarl init-tiny-model --out outputs/tiny-model && "
    "megarl make-data --task repeat_first_char --out outputs/quickstart-data && "
    "megarl train configs/quickstart.yaml trainer.total_steps=2 checkpoint.save_freq=0 trainer.output_dir={out}"
)
"""The job that must succeed: a shortened quickstart training from the uploaded working directory
(the model and data are made inside the job; only the metrics go to `{out}`, outside the upload)."""
FAILING_JOB = [
    "python",
    "-c",
    "import os, sys; sys.exit(7 if os.path.isfile('megarl/versions.py')"
    " and not os.path.exists('.git') and not os.path.exists('.venv') else 1)",
]
"""Exits 7 only in a working directory uploaded without .git and .venv (submit.sh's excludes)."""
FAILING_JOB_EXIT_CODE = 7
NODE_MARK = "MEGARL_RAY_NODE_TEMP_DIR"
"""The environment variable the start scripts mark their Ray processes with (see scripts/stop.sh)."""


def _marked_processes(temp_dir: str) -> list[psutil.Process]:
    """Live processes started by the scripts for `temp_dir` (other sessions' Ray is left alone)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(NODE_MARK) == temp_dir:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.2)


def _run(args: list[str], env: dict, timeout_s: int) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def ray_env(script_env):
    """Token authentication on, with this module's own token: Ray 2.60's default for new clusters, and
    independent of whatever ~/.ray/auth_token other Ray users of this machine left behind."""
    return {**script_env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture(scope="module")
def ray_head(ray_env):
    """A Ray head started by scripts/ray_head.sh on free ports with its own temp dir; stopped at the end."""
    temp_dir = tempfile.mkdtemp(prefix="mrl", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    gcs, dashboard, client, agent = free_ports(4)
    # 4 logical CPUs: the quickstart's two colocated device bundles hold 2 each.
    started = _run(
        [
            "bash",
            "scripts/ray_head.sh",
            "--num-cpus",
            "4",
            "--port",
            str(gcs),
            "--dashboard-port",
            str(dashboard),
            "--temp-dir",
            temp_dir,
            "--timeout",
            "120",
            "--",
            "--ray-client-server-port",
            str(client),
            "--dashboard-agent-listen-port",
            str(agent),
        ],
        ray_env,
        timeout_s=180,
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield {"address": f"http://127.0.0.1:{dashboard}", "temp_dir": temp_dir}
    finally:
        _run(["bash", "scripts/stop.sh", "--temp-dir", temp_dir], ray_env, timeout_s=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _submit(ray_head: dict, command: list[str], env: dict, *options: str) -> subprocess.CompletedProcess:
    return _run(
        ["bash", "scripts/submit.sh", "--address", ray_head["address"], *options, "--", *command], env, timeout_s=300
    )


def test_head_listens_on_loopback_only_for_the_job_api(ray_head):
    dashboard_port = int(ray_head["address"].rsplit(":", 1)[1])
    listeners = [
        conn
        for conn in psutil.net_connections("tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == dashboard_port
    ]
    assert listeners and {conn.laddr.ip for conn in listeners} == {"127.0.0.1"}


def test_quickstart_training_job_succeeds(ray_head, ray_env, tmp_path):
    job = ["bash", "-c", QUICKSTART_JOB.format(out=tmp_path)]
    result = _submit(ray_head, job, ray_env, "--wait-nodes", "1", "--wait-timeout", "60")
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]


def test_failing_job_exit_code_propagates(ray_head, ray_env):
    """The job's own exit code comes back (which also shows the upload left out .git and .venv)."""
    result = _submit(ray_head, FAILING_JOB, ray_env)
    assert result.returncode == FAILING_JOB_EXIT_CODE, result.stdout + result.stderr


def test_job_killed_by_a_signal_exits_128_plus_n(ray_head, ray_env):
    """Ray's job client reports the entrypoint's exit code (-9, or 137 from a shell): 128 + 9 either way."""
    result = _submit(ray_head, ["sh", "-c", "kill -9 $$"], ray_env)
    assert result.returncode == 128 + 9, result.stdout + result.stderr
    assert "did not succeed (exit code " in result.stderr


def test_submit_reads_the_exit_code_from_rays_job_client_not_status_text():
    script = (REPO / "scripts" / "submit.sh").read_text()
    assert "driver_exit_code" in script and "JobSubmissionClient" in script
    assert "ray job status" not in script, "the CLI's status text is not an interface: use the job client"


def _job_status(ray_head: dict, job_id: str, env: dict) -> str:
    """The job's status word through the `ray job status` CLI (a subprocess: Ray caches its auth
    mode per process, and other test modules may have imported ray with token auth off)."""
    result = _run(
        [str(Path(sys.executable).with_name("ray")), "job", "status", "--address", ray_head["address"], job_id],
        env,
        timeout_s=60,
    )
    output = result.stdout + result.stderr
    # Live jobs print "Status for job '<id>': RUNNING"; ended ones "Job '<id>' was stopped" (succeeded, failed).
    match = re.search(r"Status for job '[^']+': (\w+)|Job '[^']+' (?:was )?(stopped|succeeded|failed)", output)
    return next(g for g in match.groups() if g).upper() if match else output


def test_terminating_submit_stops_the_job(ray_head, ray_env):
    job_id = f"megarl-test-{secrets.token_hex(4)}"
    submit = subprocess.Popen(
        [
            "bash",
            "scripts/submit.sh",
            "--address",
            ray_head["address"],
            "--submission-id",
            job_id,
            "--",
            "python",
            "-c",
            "import time; time.sleep(600)",
        ],
        cwd=REPO,
        env=ray_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_until(lambda: _job_status(ray_head, job_id, ray_env) == "RUNNING", 120, f"job {job_id} to run")
        submit.terminate()
        output, _ = submit.communicate(timeout=60)
        assert submit.returncode == 130, output
        deadline, status = time.monotonic() + 90, None
        while status != "STOPPED":
            assert time.monotonic() < deadline, f"job {job_id} did not stop; last status: {status}"
            status = _job_status(ray_head, job_id, ray_env)
    finally:
        submit.kill()
        submit.wait()


def test_stop_leaves_no_ray_process(ray_head, ray_env):
    before = _marked_processes(ray_head["temp_dir"])
    names = {process.name() for process in before}
    assert {"raylet", "gcs_server"} <= names, f"expected the head's raylet and GCS among {names}"
    stopped = _run(["bash", "scripts/stop.sh", "--temp-dir", ray_head["temp_dir"]], ray_env, timeout_s=60)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    _wait_until(lambda: not _marked_processes(ray_head["temp_dir"]), 10, "the head's processes to exit")
    # A process in the middle of exiting has an unreadable environment, so it no longer counts as
    # marked while it is still listed: give it the same bound to be gone (or a zombie) for good.
    _wait_until(lambda: not any(_alive(process) for process in before), 10, "every process of the head to be gone")


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_worker_gives_up_on_an_absent_head_within_its_timeout(ray_env):
    """The worker polls the head's health with a bounded retry and never starts Ray without a head."""
    temp_dir = tempfile.mkdtemp(prefix="mrlw", dir="/tmp")
    # Bound but not listening: connections are refused, and no other process can take the port meanwhile.
    with socket.socket() as absent_head:
        absent_head.bind(("127.0.0.1", 0))
        port = absent_head.getsockname()[1]
        try:
            result = _run(
                [
                    "bash",
                    "scripts/ray_worker.sh",
                    "--address",
                    f"127.0.0.1:{port}",
                    "--timeout",
                    "3",
                    "--temp-dir",
                    temp_dir,
                ],
                ray_env,
                timeout_s=60,
            )
            assert result.returncode == 1, result.stdout + result.stderr
            assert "did not answer a health check within 3s" in result.stderr
            assert "Ray runtime started" not in result.stdout + result.stderr
            assert _marked_processes(temp_dir) == []
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
