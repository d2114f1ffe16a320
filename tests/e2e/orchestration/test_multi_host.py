"""Two hosts on one machine (network namespaces on one switch, `tests/netns_testing.py`), set up the way a
user sets up two machines: the real `scripts/ray_head.sh` on host A and `scripts/ray_worker.sh` on host B
(each with `--iface`, so Ray, Gloo and NCCL use the hosts' own addresses), and a GRPO job submitted with the
real `scripts/submit.sh --wait-nodes 2` (issue 32, item 12).

The job places 4 processes on 2 nodes of 2 CPUs each (split: 2 trainer ranks at TP 2, 2 rollout engines),
so processes of the weight-sync group sit on both hosts and the collective sync (the shared transports
need one node) crosses the switch; every step's sync is verified by exact checksums and the log-prob
check. Then host B is cut off mid-run (its switch port down: its processes live on, silent, as behind a
pulled cable): the job ends within the hang timeout with one line naming B's address and the step, exits
1, and leaves no process of the job on either host once B is back on the switch. On the restored cluster
the same command resumes from the last checkpoint and trains two more steps. Each host's processes see a
/dev/shm of their own (`shm_testing`), left empty. Nothing leaves the hosts' namespaces (a /24 of their
own, no route out)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns_testing import Host, hosts, skip_reason
from shm_testing import PrivateShm

from megarl.trainer.checkpoint_manager import CheckpointManager
from tests.e2e.reliability.reliability_job import make_workspace

pytestmark = [pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
STEPS = 1000
"""Far more than the run reaches before host B is lost: the loss always lands mid-run (a step takes ~1 s)."""
RESUMED_STEPS = 2
"""Steps the resume trains after the last checkpoint (`trainer.total_steps` is not part of what a resume checks)."""
HANG_TIMEOUT_S = 15
"""`trainer.hang_timeout_s`: how long B's ranks may be silent before the driver names them."""
JOB_END_S = 240.0
"""Bound on a job's end once its node is cut off: B's ranks' heartbeats stop, after the hang timeout the
driver's wait names them (`WorkerFailure`), kills the groups and the run stops."""
ORPHANS_GONE_S = 180.0
"""Bound on the end of B's job processes once B is back: its raylet learns from the head that the job
ended (or that the node was declared dead) and ends them."""


def environment() -> dict[str, str]:
    """The venv's tools first on PATH (the scripts call `ray`, the job calls `megarl`), this checkout importable."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(name, None)
    # As scripts/lib/ray_node.sh: a token on this machine turns Ray's token authentication on, and the
    # state CLI sends it only when told to.
    token_file = Path(env.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if "RAY_AUTH_MODE" not in env and (
        env.get("RAY_AUTH_TOKEN") or (token_file.is_file() and token_file.stat().st_size)
    ):
        env["RAY_AUTH_MODE"] = "token"
    return env


@dataclass(frozen=True)
class RayNode:
    """The Ray node of a host: its temp dir and the private /dev/shm its processes see (`shm_testing`)."""

    host: Host
    temp_dir: str
    shm: PrivateShm

    def start(self, script: str, *args: str) -> None:
        """`scripts/<script>` (ray_head.sh or ray_worker.sh) on the host, on its own interface."""
        argv = [str(REPO / "scripts" / script), "--iface", self.host.iface, "--num-cpus", "2", "--num-gpus", "0"]
        argv += ["--temp-dir", self.temp_dir, "--timeout", "120", *args]
        done = self.host.run(
            self.shm.wrap(["bash", *argv]), env=environment(), capture_output=True, text=True, timeout=240
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    def stop(self) -> None:
        self.host.run(
            ["bash", str(REPO / "scripts" / "stop.sh"), "--temp-dir", self.temp_dir, "--timeout", "2"],
            env=environment(),
            capture_output=True,
            timeout=120,
        )


def submit(host, workspace: Path, out: Path, steps: int) -> subprocess.Popen:
    """`megarl train` of the workspace's recipe for `steps` steps as a Ray job from host A; output in out/submit.log."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        "bash",
        str(REPO / "scripts" / "submit.sh"),
        "--wait-nodes",
        "2",
        "--wait-timeout",
        "120",
        "--",
        "megarl",
        "train",
        str(workspace / "recipe.yaml"),
        "placement.mode=split",
        "placement.nnodes=2",
        "placement.gpus_per_node=2",
        "placement.rollout_gpus=2",
        f"trainer.total_steps={steps}",
        "checkpoint.save_freq=1",
        f"trainer.output_dir={out}",
        f"checkpoint.dir={out / 'ckpt'}",
        f"trainer.hang_timeout_s={HANG_TIMEOUT_S}",
    ]
    with open(out / "submit.log", "ab") as log:
        return host.popen(command, env=environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def metrics(out: Path) -> list[dict]:
    path = out / "quickstart" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(1.0)  # polling files and processes another process writes: no event to wait on


def job_processes(host) -> list[str]:
    """The command lines of the job's processes running on `host`: its driver (`megarl train`) and ranks."""
    found = []
    for pid in host.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if "RankProcess" in cmdline or "megarl train" in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def rank_nodes(host) -> list[str]:
    """The node address of each alive megarl rank process (Ray's state API, asked on the head's host)."""

    def listed(kind: str, *filters: str) -> list[dict]:
        done = host.run(
            [
                "ray",
                "list",
                kind,
                "--address",
                "http://127.0.0.1:8265",
                "--format",
                "json",
                "--limit",
                "1000",
                *[arg for f in filters for arg in ("--filter", f)],
            ],
            env=environment(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        text = done.stdout.strip()
        # Ray's state CLI prints an empty listing as a sentence, not as JSON (state_cli.format_list_api_output).
        return [] if text in ("", "No resource in the cluster") else json.loads(text)

    ip_of = {node["node_id"]: node["node_ip"] for node in listed("nodes")}
    return sorted(ip_of[actor["node_id"]] for actor in listed("actors", "class_name=RankProcess", "state=ALIVE"))


def test_a_run_spans_two_hosts_survives_losing_one_as_a_clean_stop_and_resumes(tmp_path):
    workspace = make_workspace(tmp_path / "workspace")
    out = tmp_path / "run"
    with hosts(2) as (a, b):
        # Temp dirs short: Ray's socket paths must fit in 107 bytes.
        head, worker = (
            RayNode(host, tempfile.mkdtemp(prefix=f"mrl{name}", dir="/tmp"), PrivateShm.make())
            for host, name in ((a, "a"), (b, "b"))
        )
        job = None
        try:
            head.start("ray_head.sh")
            worker.start("ray_worker.sh", "--address", f"{a.ip}:6379")
            job = submit(a, workspace, out, STEPS)
            wait_for(lambda: len(metrics(out)) >= 2 or job.poll() is not None, "step 2 logged", 300)
            assert job.poll() is None, (out / "submit.log").read_text()[-4000:]
            assert rank_nodes(a) == [a.ip, a.ip, b.ip, b.ip]  # 2 trainer ranks and 2 engines, 2 per host
            for record in metrics(out):  # the sync that crossed the hosts arrived bit-exact
                assert record["sync/checksum_tensors"] > 0 and record["sync/logprob_max_abs_diff"] < 1e-4

            cut_at = time.monotonic()
            b.cut()
            assert job.wait(JOB_END_S) == 1
            print(f"the job ended {time.monotonic() - cut_at:.0f} s after host B was cut off")
            log = (out / "submit.log").read_text()
            # One line from the driver (Ray's job CLI repeats the end of a failed job's log once more).
            failed = {line for line in log.splitlines() if line.startswith("megarl train: failed during step")}
            assert len(failed) == 1, log[-4000:]
            assert f"on node {b.ip}" in log and "submit.sh: job " in log and "(exit code 1)" in log, log[-4000:]
            assert job_processes(a) == []  # the driver and A's ranks ended with the job
            b.reconnect()
            wait_for(lambda: job_processes(b) == [], "host B's ranks ended once B was back", ORPHANS_GONE_S)
            print(f"host B's ranks ended {time.monotonic() - cut_at:.0f} s after it was cut off")
            last = CheckpointManager(out / "ckpt").latest().step
            assert last >= 2

            worker.stop()  # B's Ray, whatever the head made of it, makes way for a fresh node
            worker.start("ray_worker.sh", "--address", f"{a.ip}:6379")
            job = submit(a, workspace, out, last + RESUMED_STEPS)
            assert job.wait(600) == 0, (out / "submit.log").read_text()[-4000:]
            steps = [record["step"] for record in metrics(out)]
            assert steps == list(range(1, last + RESUMED_STEPS + 1)), steps  # one record per step, the resume's after
            worker.stop()
            head.stop()
            assert head.shm.leftovers() == [] and worker.shm.leftovers() == []  # in /dev/shm, from either host
        finally:
            if job is not None and job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)  # submit.sh and its `ray job submit`
                job.wait()
            b.reconnect()
            for node in (worker, head):
                node.stop()
                node.shm.remove()
                shutil.rmtree(node.temp_dir, ignore_errors=True)
