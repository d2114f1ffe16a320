"""A running local job: what listens on the network, what user reward code can see, what is logged.

One job (3 steps) for the module, with canary secrets in every credential variable megarl knows of
(`megarl.credentials.KNOWN`) in the driver's environment, and a reward function that records its own
environment and searches every environment on the machine for them. The scorer's own isolation (time limit, process group
kill, credential filter) is tested in tests/unit/rewards/test_rewards_scorer.py.
"""

import hashlib
import ipaddress
import json
import os
import secrets

import psutil
import pytest
from reliability_job import Job

from megarl import quiet
from megarl.credentials import KNOWN
from megarl.workers.rollout import cpu_numa_line

# Unique to this session: another job on the machine cannot hold them.
CANARIES = {name: f"{name.lower()}-canary-{secrets.token_hex(8)}" for name in KNOWN}


@pytest.fixture(scope="module")
def live_job(workspace, tmp_path_factory):
    """The job after step 1 (still running), with the listening sockets seen then; the test that
    needs its end calls `job.wait()`."""
    run_dir = tmp_path_factory.mktemp("security")
    job = Job.start(
        workspace,
        run_dir,
        ["reward.function=reliability_rewards:env_probe", "trainer.total_steps=3"],
        env={
            **CANARIES,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(workspace), os.environ.get("PYTHONPATH")])),
            "RELIABILITY_PROBE_FILE": str(run_dir / "probe"),
            "RELIABILITY_CANARY_DIGESTS": ",".join(hashlib.sha256(v.encode()).hexdigest() for v in CANARIES.values()),
        },
    )
    try:
        job.wait_for(lambda: job.last_step() >= 1, "step 1 logged")
        job.listening = listening_sockets([psutil.Process(job.process.pid), *job.descendants()])
        yield job
    finally:
        job.cleanup()


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 and ::1, also written as IPv4-mapped IPv6 (`::ffff:127.0.0.1`, how a dual-stack
    socket bound to 127.0.0.1 shows), which Python 3.11's `is_loopback` does not see through."""
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def listening_sockets(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket in LISTEN state held by `processes`."""
    found = []
    for process in processes:
        try:
            connections = process.net_connections(kind="tcp")
            name = " ".join(process.cmdline())[:80]
        except psutil.Error:
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def test_every_listening_socket_is_bound_to_loopback(live_job):
    assert live_job.listening, "the job's processes should listen somewhere (Ray's GCS at least)"
    exposed = [s for s in live_job.listening if not is_loopback(s[1])]
    assert exposed == [], "sockets reachable from other machines:\n" + "\n".join(map(str, exposed))


def test_reward_code_runs_in_another_process_without_the_drivers_secrets(live_job):
    assert live_job.wait() == 0, live_job.output()[-4000:]
    probes = [json.loads(p.read_text()) for p in live_job.run_dir.glob("probe.*")]
    assert probes, "the reward function never ran"
    for probe in probes:
        assert probe["pid"] != live_job.process.pid and probe["ppid"] == live_job.process.pid
        assert not set(CANARIES) & set(probe["environ"])
        assert not [v for v in probe["environ"].values() if any(c in v for c in CANARIES.values())]
        # Nor in the driver's /proc/<pid>/environ, Ray's, the workers' or any other process's.
        assert probe["found"] == []


def test_no_secret_reaches_the_run_dir_or_rays_logs(live_job):
    assert live_job.wait() == 0, live_job.output()[-4000:]
    leaks = []
    for root in (live_job.run_dir, live_job.ray_tmp):
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink() and not path.name.startswith("probe."):
                data = path.read_bytes()
                leaks += [(str(path), name) for name, value in CANARIES.items() if value.encode() in data]
    assert leaks == []


# What the quickstart printed before step 1 that no user can act on (megarl.quiet's table).
UNACTIONABLE = (
    [message for message, _ in quiet.ALWAYS + quiet.CUDA_ADVICE]
    + list(quiet.LOGS.values())
    + ["Loading safetensors checkpoint shards", cpu_numa_line.LINE_START]
)


def test_the_console_before_step_1_shows_the_users_warning_and_none_unactionable(live_job):
    assert live_job.wait() == 0, live_job.output()[-4000:]
    out = live_job.output()
    before_step_1 = out[: out.index("\nstep 1/")]
    assert [message for message in UNACTIONABLE if message in before_step_1] == [], before_step_1
    assert "env_probe: a warning from user code" in before_step_1, before_step_1
