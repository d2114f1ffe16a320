"""scripts/slurm/megarl.sbatch with fake `srun` / `scontrol` / `sinfo` on PATH (scripts that log their
calls): the head on the first node, one worker per other node, the job submitted on the head, a bad node
list or option rejected before the first srun, node steps with the node's CPUs and memory, a dead node
stopping the job at once, fixed ports, the apptainer path; and the blocking Ray node scripts copying their
logs when stopped (with a fake `ray`)."""

import os
import signal
import socket
import subprocess
import time

import pytest
from deploy_support import REPO, VENV_BIN

SBATCH = REPO / "scripts" / "slurm" / "megarl.sbatch"
HEAD_IP = "10.0.0.1"
COMMAND = ["megarl", "train", "configs/grpo_qwen2.5-7b_gsm8k.yaml"]
CPUS = 96
"""SLURM_CPUS_ON_NODE in the batch step: what each Ray node step must ask for."""

FAKES = {
    # Logs each call on one line; answers the head-IP lookup. A Ray node step runs until it is signalled (as
    # `ray start --block` does; it logs `ready` once up), or on $FAKE_DEAD_NODE exits 1 once $FAKE_OTHERS other
    # steps are up. The job step acts like submit.sh --wait-nodes N: it waits (bounded) until N Ray node steps
    # are up, then exits $FAKE_JOB_RC; with FAKE_JOB_HANGS it runs until signalled (a job waiting for a node
    # that is gone).
    "srun": f"""#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$FAKE_LOG"
# Runs until SIGTERM, then logs $1 and exits 143. The sleep writes to no pipe of the test, in case a signal
# comes between its start and `sleeper=$!` and leaves it behind.
stop_on_term() {{
  sleeper=""
  trap 'printf "%s\\n" "$1" >> "$FAKE_LOG"; [ -z "$sleeper" ] || kill "$sleeper"; exit 143' TERM
  sleep 120 >/dev/null 2>&1 </dev/null & sleeper=$!
  echo ready >> "$FAKE_LOG"
  wait "$sleeper"
}}
case "$*" in
  *"hostname --ip-address"*) echo "{HEAD_IP} fe80::1" ;;
  *scripts/ray_head.sh*|*scripts/ray_worker.sh*)
    case " $* " in
      *" --nodelist=${{FAKE_DEAD_NODE:-none}} "*)
        # Dies once every other step is up (the job waiting for this node).
        for _ in $(seq 100); do
          [ "$(grep -c '^ready$' "$FAKE_LOG")" -ge "$FAKE_OTHERS" ] && exit 1
          sleep 0.1
        done
        exit 99 ;;
    esac
    stop_on_term "stopped $*" ;;
  *scripts/submit.sh*)
    if [ -n "${{FAKE_JOB_HANGS:-}}" ]; then
      stop_on_term "stopped job"
    fi
    want="$(printf '%s\\n' "$*" | sed -n 's/.*--wait-nodes \\([0-9]*\\).*/\\1/p')"
    for _ in $(seq 100); do
      [ "$(grep -c '^ready$' "$FAKE_LOG")" -ge "$want" ] && exit "${{FAKE_JOB_RC:-0}}"
      sleep 0.1
    done
    exit 99 ;;
esac
""",
    "scontrol": """#!/usr/bin/env bash
printf 'scontrol %s\\n' "$*" >> "$FAKE_SCONTROL_LOG"
[ "$1 $2" = "show hostnames" ] || exit 1
printf '%s\\n' $FAKE_HOSTNAMES
""",
    "sinfo": """#!/usr/bin/env bash
printf 'sinfo %s\\n' "$*" >> "$FAKE_SCONTROL_LOG"
""",
}


@pytest.fixture
def slurm(tmp_path, script_env):
    """Runs the sbatch script under the fakes; returns (result, srun calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    srun_log = tmp_path / "srun.log"

    def run(
        hostnames: list[str],
        num_nodes: int,
        job_rc: int = 0,
        options: tuple = ("--venv", str(VENV_BIN.parent)),
        **fake_env,
    ):
        env = {
            **script_env,
            "PATH": f"{bin_dir}:{script_env['PATH']}",
            "FAKE_LOG": str(srun_log),
            "FAKE_SCONTROL_LOG": str(tmp_path / "scontrol.log"),
            "FAKE_HOSTNAMES": " ".join(hostnames),
            "FAKE_JOB_RC": str(job_rc),
            "SLURM_JOB_NODELIST": "gpu[01-99]",
            "SLURM_JOB_NUM_NODES": str(num_nodes),
            "SLURM_JOB_ID": "4242",
            "SLURM_SUBMIT_DIR": str(REPO),
            "SLURM_CPUS_ON_NODE": str(CPUS),
            "MEGARL_APPTAINER_IMAGE": "",
            **fake_env,
        }
        result = subprocess.run(
            ["bash", str(SBATCH), "--log-dir", str(tmp_path / "ray-logs"), *options, "--", *COMMAND],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        calls = srun_log.read_text().splitlines() if srun_log.exists() else []
        return result, [call for call in calls if call != "ready"]

    return run


def _nodelist(call: str) -> str:
    (node,) = [arg.split("=", 1)[1] for arg in call.split() if arg.startswith("--nodelist=")]
    return node


@pytest.mark.parametrize("count", [1, 2, 5])
def test_head_on_first_node_and_one_worker_per_other_node(slurm, count):
    nodes = [f"gpu{index:02d}" for index in range(1, count + 1)]
    result, calls = slurm(nodes, count)
    assert result.returncode == 0, result.stdout + result.stderr
    lookup, *steps = calls
    assert "hostname --ip-address" in lookup and _nodelist(lookup) == nodes[0]
    steps = [call for call in steps if not call.startswith("stopped ")]
    heads = [call for call in steps if "scripts/ray_head.sh" in call]
    workers = [call for call in steps if "scripts/ray_worker.sh" in call]
    submits = [call for call in steps if "scripts/submit.sh" in call]
    assert len(heads) + len(workers) + len(submits) == len(steps), steps
    (head,) = heads
    assert _nodelist(head) == nodes[0] and "--block" in head.split()
    assert sorted(_nodelist(call) for call in workers) == nodes[1:], "each other node runs exactly one worker"
    assert all(f"--address {HEAD_IP}:6379" in call and "--block" in call.split() for call in workers)
    (submit,) = submits
    assert _nodelist(submit) == nodes[0] and "--overlap" in submit.split()
    assert f"--wait-nodes {count}" in submit and submit.endswith("-- " + " ".join(COMMAND))


def test_exit_code_is_the_jobs(slurm):
    result, _ = slurm(["gpu01", "gpu02"], 2, job_rc=3)
    assert result.returncode == 3, result.stdout + result.stderr


@pytest.mark.parametrize(
    "hostnames, num_nodes, message",
    [
        ([], 2, "returned no node"),
        (["gpu01", "gpu02"], 3, "expands to 2 node(s)"),
        (["gpu01", "gpu01"], 2, "appears twice"),
        (["gpu01", "bad_node!"], 2, "is not a host name"),
    ],
    ids=["empty", "count-mismatch", "duplicate", "bad-name"],
)
def test_bad_node_list_fails_before_any_srun(slurm, hostnames, num_nodes, message):
    result, calls = slurm(hostnames, num_nodes)
    assert result.returncode != 0
    assert message in result.stderr
    assert calls == [], f"srun was called despite the bad node list: {calls}"


def test_help_needs_no_slurm():
    result = subprocess.run(["bash", str(SBATCH), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "scontrol show hostnames" in result.stdout


def _node_steps(calls: list[str]) -> list[str]:
    return [
        call
        for call in calls
        if ("scripts/ray_head.sh" in call or "scripts/ray_worker.sh" in call) and not call.startswith("stopped ")
    ]


def test_ray_node_steps_get_the_nodes_cpus_and_memory_and_copy_their_logs(slurm, tmp_path):
    result, calls = slurm(["gpu01", "gpu02", "gpu03"], 3)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = _node_steps(calls)
    assert len(steps) == 3
    for call in steps:
        args = call.split()
        assert f"--cpus-per-task={CPUS}" in args and "--mem=0" in args, call
        assert f"--log-copy-dir {tmp_path / 'ray-logs'}" in call, call
    assert (tmp_path / "ray-logs").is_dir()
    assert sorted(call for call in calls if call.startswith("stopped ")) == sorted(
        f"stopped {call}" for call in steps
    ), "every Ray node step is stopped (and copies its logs) when the job ends"


@pytest.mark.parametrize("dead, role", [("gpu01", "head"), ("gpu03", "worker")])
def test_a_dead_node_stops_the_job_at_once_naming_it(slurm, dead, role):
    """The job step would wait (here: forever) for the node; the ended Ray step is noticed instead."""
    result, calls = slurm(["gpu01", "gpu02", "gpu03"], 3, FAKE_DEAD_NODE=dead, FAKE_JOB_HANGS="1", FAKE_OTHERS="3")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"the Ray {role} {dead} step ended (exit code 1) while the job ran; stopping the job" in result.stderr
    assert "stopped job" in calls
    alive = [call for call in _node_steps(calls) if f"--nodelist={dead} " not in call]
    assert len(alive) == 2 and all(f"stopped {call}" in calls for call in alive)


def test_fixed_ports_for_firewalled_sites(slurm):
    result, calls = slurm(
        ["gpu01", "gpu02"],
        2,
        options=("--venv", str(VENV_BIN.parent), "--node-ports", "20000", "--worker-ports", "21000-21999"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (head,) = [call for call in calls if "scripts/ray_head.sh" in call and not call.startswith("stopped ")]
    (worker,) = [call for call in calls if "scripts/ray_worker.sh" in call and not call.startswith("stopped ")]
    node_ports = (
        "--node-manager-port 20000 --object-manager-port 20001 --dashboard-agent-grpc-port 20002 "
        "--dashboard-agent-listen-port 20003 --metrics-export-port 20004 --runtime-env-agent-port 20005 "
        "--min-worker-port 21000 --max-worker-port 21999"
    )
    assert head.endswith(f"-- {node_ports} --ray-client-server-port 20006") and "--port 6379" in head
    assert worker.endswith(f"-- {node_ports}")


@pytest.mark.parametrize(
    "options, message",
    [
        (("--node-ports", "80"), "--node-ports 80: BASE..BASE+6 must lie in 1024..65535"),
        (("--node-ports", "20k"), "--node-ports must be a whole number"),
        (("--worker-ports", "21999-21000"), "--worker-ports must be MIN-MAX"),
        (("--cpus-per-node", "0"), "--cpus-per-node must be at least 1"),
        (("--venv", "/x", "--apptainer", "/y.sif"), "exclude each other"),
    ],
    ids=["low-port", "not-a-port", "reversed-range", "no-cpus", "two-modes"],
)
def test_bad_options_fail_before_any_srun(slurm, options, message):
    result, calls = slurm(["gpu01", "gpu02"], 2, options=options)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert calls == []


@pytest.mark.parametrize("by", ["option", "variable"])
def test_apptainer_runs_every_step_in_the_image(slurm, tmp_path, by):
    image = tmp_path / "megarl.sif"
    image.write_text("")
    if by == "option":
        result, calls = slurm(["gpu01", "gpu02"], 2, options=("--apptainer", str(image)))
    else:
        result, calls = slurm(["gpu01", "gpu02"], 2, options=(), MEGARL_APPTAINER_IMAGE=str(image))
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [call for call in calls if "scripts/" in call and not call.startswith("stopped ")]
    assert len(steps) == 3
    wrapper = f"apptainer exec --nv --pwd /opt/megarl --bind {tmp_path / 'ray-logs'} {image} bash scripts/"
    assert all(wrapper in call for call in steps), steps


_FAKE_RAY = """#!/usr/bin/env bash
# `ray start ... --temp-dir T ... --block`: writes a log under T/session_latest, then runs until SIGTERM.
[ "$1" = start ] || exit 0
while [ "$1" != --temp-dir ]; do shift; done
session="$2/session_2026"
mkdir -p "$session/logs" && ln -sfn "$session" "$2/session_latest"
echo started > "$session/logs/raylet.out"
trap 'echo stopped >> "$session/logs/raylet.out"; kill "$sleeper"; exit 0' TERM
sleep 600 & sleeper=$!
wait "$sleeper"
"""


@pytest.mark.parametrize("script", ["ray_head.sh", "ray_worker.sh"])
def test_blocking_node_copies_its_ray_logs_when_stopped(script, tmp_path, script_env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(_FAKE_RAY)
    (bin_dir / "ray").chmod(0o755)
    temp_dir, copies = tmp_path / "ray", tmp_path / "shared" / "ray-logs"
    env = {**script_env, "PATH": f"{bin_dir}:{script_env['PATH']}"}
    # The worker waits for the head's port first: a listening socket stands in for the head.
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        address = f"127.0.0.1:{head.getsockname()[1]}"
        extra = ["--address", address] if script == "ray_worker.sh" else []
        node = subprocess.Popen(
            [
                "bash",
                str(REPO / "scripts" / script),
                *extra,
                "--temp-dir",
                str(temp_dir),
                "--block",
                "--log-copy-dir",
                str(copies),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        log = temp_dir / "session_latest" / "logs" / "raylet.out"
        deadline = time.monotonic() + 60
        while not log.exists():
            assert node.poll() is None and time.monotonic() < deadline, node.communicate()
            time.sleep(0.1)
        node.send_signal(signal.SIGTERM)
        out, err = node.communicate(timeout=60)
    assert node.returncode == 0, out + err
    copied = copies / os.uname().nodename / "logs" / "raylet.out"
    assert copied.read_text() == "started\nstopped\n", "copied after Ray stopped"
    assert f"Ray logs copied to {copies / os.uname().nodename}/logs" in out


@pytest.mark.parametrize("script", ["ray_head.sh", "ray_worker.sh"])
def test_log_copy_needs_block(script, tmp_path):
    address = ["--address", "127.0.0.1:1"] if script == "ray_worker.sh" else []
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / script), *address, "--log-copy-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "--log-copy-dir needs --block" in result.stderr, result.stderr
