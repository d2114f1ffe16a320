"""scripts/slurm/megarl.sbatch with fake `srun` / `scontrol` / `sinfo` on PATH (scripts that log their
calls): the head on the first node, one worker per other node, the job submitted on the head, and a
bad node list rejected before the first srun."""

import subprocess

import pytest
from deploy_support import REPO, VENV_BIN

SBATCH = REPO / "scripts" / "slurm" / "megarl.sbatch"
HEAD_IP = "10.0.0.1"
COMMAND = ["megarl", "train", "configs/grpo_qwen2.5-7b_gsm8k.yaml"]

FAKES = {
    # Logs each call on one line; answers the head-IP lookup. The job step acts like submit.sh
    # --wait-nodes N: it waits (bounded) until N Ray node steps were launched, then exits $FAKE_JOB_RC.
    "srun": f"""#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$FAKE_LOG"
case "$*" in
  *"hostname --ip-address"*) echo "{HEAD_IP} fe80::1" ;;
  *scripts/submit.sh*)
    want="$(printf '%s\\n' "$*" | sed -n 's/.*--wait-nodes \\([0-9]*\\).*/\\1/p')"
    for _ in $(seq 100); do
      [ "$(grep -c -e ray_head.sh -e ray_worker.sh "$FAKE_LOG")" -ge "$want" ] && exit "${{FAKE_JOB_RC:-0}}"
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

    def run(hostnames: list[str], num_nodes: int, job_rc: int = 0):
        env = {**script_env, "PATH": f"{bin_dir}:{script_env['PATH']}", "FAKE_LOG": str(srun_log),
               "FAKE_SCONTROL_LOG": str(tmp_path / "scontrol.log"), "FAKE_HOSTNAMES": " ".join(hostnames),
               "FAKE_JOB_RC": str(job_rc), "SLURM_JOB_NODELIST": "gpu[01-99]", "SLURM_JOB_NUM_NODES": str(num_nodes),
               "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(REPO)}
        result = subprocess.run(["bash", str(SBATCH), "--venv", str(VENV_BIN.parent), "--", *COMMAND],
                                env=env, capture_output=True, text=True, timeout=60)
        calls = srun_log.read_text().splitlines() if srun_log.exists() else []
        return result, calls

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


@pytest.mark.parametrize("hostnames, num_nodes, message", [
    ([], 2, "returned no node"),
    (["gpu01", "gpu02"], 3, "expands to 2 node(s)"),
    (["gpu01", "gpu01"], 2, "appears twice"),
    (["gpu01", "bad_node!"], 2, "is not a host name"),
], ids=["empty", "count-mismatch", "duplicate", "bad-name"])
def test_bad_node_list_fails_before_any_srun(slurm, hostnames, num_nodes, message):
    result, calls = slurm(hostnames, num_nodes)
    assert result.returncode != 0
    assert message in result.stderr
    assert calls == [], f"srun was called despite the bad node list: {calls}"


def test_help_needs_no_slurm():
    result = subprocess.run(["bash", str(SBATCH), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "scontrol show hostnames" in result.stdout
