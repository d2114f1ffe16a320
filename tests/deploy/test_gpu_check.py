"""scripts/gpu_check.sh on this CPU machine: it runs tests/gpu, every test is reported skipped (no
CUDA), the JSON report has its schema, and the exit code is 0. On a GPU machine the same script runs
them for real (its report then goes to benchmarks/results/gpu_check.json). Its GPU-only steps (driver
floor, NCCL probe, quickstart runs on cuda) run here against a fake nvidia-smi and an interpreter that
fakes only the CUDA processes; scripts/nccl_probe.py runs for real on gloo."""

import ast
import json
import os
import re
import subprocess
import sys

from deploy_support import REPO

from megarl import versions

REQUIRED_VERSIONS = {"torch", "megatron-core", "ray", "cuda_runtime", "driver"}


def _gpu_test_ids() -> set[str]:
    """Every test function of tests/gpu, read from the sources."""
    ids = set()
    for path in sorted((REPO / "tests" / "gpu").glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                ids.add(f"{path.relative_to(REPO)}::{node.name}")
    return ids


def test_gpu_check_reports_every_gpu_test_skipped_without_cuda(tmp_path):
    report_path = tmp_path / "report" / "gpu_check.json"
    result = subprocess.run(
        [
            "bash",
            "scripts/gpu_check.sh",
            "--python",
            sys.executable,
            "--report",
            str(report_path),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["device"] == {"cuda_available": False, "count": 0}
    assert set(report["versions"]) >= REQUIRED_VERSIONS
    # one entry per test, or per case of a parametrized one (`name[case]`)
    assert {nodeid.split("[")[0] for nodeid in report["tests"]} == _gpu_test_ids() and len(report["tests"]) >= 4
    for entry in report["tests"].values():
        assert entry["outcome"] == "skipped" and "no CUDA device" in entry["reason"]
        assert entry["memory"] == {}
    assert report["summary"] == {"passed": 0, "failed": 0, "skipped": len(report["tests"])}
    assert "no CUDA device; 0 failed, 0 passed" in result.stdout
    assert "no nvidia-smi (no NVIDIA driver): driver check, NCCL probe and CUDA runs skipped" in result.stdout


def test_gpu_check_refuses_an_interpreter_without_megarl(tmp_path):
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--python", "/usr/bin/false"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "cannot import megarl" in result.stderr and "--python" in result.stderr


# NCCL's INFO lines for the network it loads: "NET/IB : Using%s %s; OOB %s:%s" and "NET/IB : No device
# found." (src/transport/net_ib.cc), "NET/Socket : Using%s" (src/transport/net_socket.cc), each prefixed by
# NCCL's "host:pid:tid [dev] NCCL INFO " header.
NCCL_IB = "h:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.0.0.2<0>"
NCCL_SOCKET = (
    "h:1:1 [0] NCCL INFO NET/IB : No device found.\nh:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>"
)

FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
# nvidia-smi --query-gpu=driver_version --format=csv,noheader: one line per GPU
[ "$*" = "--query-gpu=driver_version --format=csv,noheader" ] || { echo "unexpected: $*" >&2; exit 9; }
for _ in $(seq "$FAKE_GPUS"); do echo "$FAKE_DRIVER"; done
"""

FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the CUDA interpreter where CUDA is needed; everything else runs on the real one.
echo "$*" >> "$FAKE_LOG"
case "$1 $2" in
  "-m torch.distributed.run")
    printf '%s\\n' "$FAKE_NCCL_LINES"
    [ "$FAKE_PROBE_RC" = 0 ] && echo "nccl_probe: world $FAKE_GPUS, 256 MiB, algbw 180.00 GB/s, busbw 315.00 GB/s"
    exit "$FAKE_PROBE_RC" ;;
  "-m pytest")
    echo '{"device": {"cuda_available": true, "count": '"$FAKE_GPUS"', "name": "H100"},
           "summary": {"passed": 9, "failed": 0, "skipped": 0}}' > "$MEGARL_GPU_REPORT"
    exit 0 ;;
  "-m megarl.cli.main")
    if [ "$3" = train ] && [ -n "$FAKE_TRAIN_FAILS" ] && [[ "$*" == *"$FAKE_TRAIN_FAILS"* ]]; then
      echo "torch.OutOfMemoryError: CUDA out of memory"; exit 1
    fi
    exit 0 ;;
esac
exec "$REAL_PYTHON" "$@"
"""


def _fake_gpu_run(tmp_path, *, gpus=2, driver="580.95.05", nccl=NCCL_IB, probe_rc=0, train_fails=""):
    """scripts/gpu_check.sh with a fake nvidia-smi on PATH and a fake interpreter (above)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [("nvidia-smi", FAKE_NVIDIA_SMI), ("python", FAKE_PYTHON)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_GPUS": str(gpus),
        "FAKE_DRIVER": driver,
        "FAKE_NCCL_LINES": nccl,
        "FAKE_PROBE_RC": str(probe_rc),
        "FAKE_TRAIN_FAILS": train_fails,
        "FAKE_LOG": str(log),
        "REAL_PYTHON": sys.executable,
    }
    result = subprocess.run(
        [
            "bash",
            "scripts/gpu_check.sh",
            "--python",
            str(bin_dir / "python"),
            "--report",
            str(tmp_path / "report" / "gpu_check.json"),
            "--work",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return result, calls


def _train_calls(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("-m megarl.cli.main train ")]


def test_gpu_check_stops_below_the_driver_floor(tmp_path):
    result, calls = _fake_gpu_run(tmp_path, driver="570.124.06")
    assert result.returncode == 3, result.stdout + result.stderr
    assert (
        f"NVIDIA driver 570.124.06 is older than {versions.CUDA_DRIVER_MIN}" in result.stderr
        and "upgrade the host's driver" in result.stderr
    )
    assert not any(call.startswith("-m ") for call in calls), "nothing may run below the driver floor"


def test_gpu_check_two_gpus_probe_ib_and_both_cuda_runs(tmp_path):
    result, calls = _fake_gpu_run(tmp_path, driver="580.95.05")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"NVIDIA driver 580.95.05 (floor {versions.CUDA_DRIVER_MIN}): OK; 2 GPU(s)" in out
    (probe,) = [call for call in calls if call.startswith("-m torch.distributed.run")]
    assert probe == "-m torch.distributed.run --standalone --nproc-per-node 2 scripts/nccl_probe.py"
    assert "busbw 315.00 GB/s" in out and "NCCL network: NET/IB (InfiniBand/RoCE)" in out
    fp32, tp2 = _train_calls(calls)
    for run in (fp32, tp2):
        assert " configs/quickstart.yaml trainer.device=cuda trainer.total_steps=2 " in run
    assert "actor.parallel.tensor_model_parallel_size=1 placement.gpus_per_node=1" in fp32
    assert tp2.endswith(
        "actor.parallel.tensor_model_parallel_size=2 rollout.tensor_model_parallel_size=2 placement.gpus_per_node=2"
    )
    assert "quickstart_fp32_cuda: OK" in out and "quickstart_tp2_colocated: OK" in out
    assert out.rstrip().endswith("gpu_check.sh: all checks passed")


def test_gpu_check_one_gpu_socket_fallback_and_a_failed_run(tmp_path):
    result, calls = _fake_gpu_run(tmp_path, gpus=1, nccl=NCCL_SOCKET, train_fails="trainer.device=cuda")
    assert result.returncode == 1
    assert "NCCL network: NET/Socket (TCP): no usable InfiniBand device" in result.stdout
    assert len(_train_calls(calls)) == 1 and "TP 2 / rollout TP 2 colocated run skipped: 1 GPU" in result.stdout
    log = tmp_path / "out" / "quickstart_fp32_cuda" / "train.log"
    assert "ERROR: quickstart_fp32_cuda failed or ran past 420s" in result.stderr and str(log) in result.stderr
    assert "CUDA out of memory" in result.stderr  # the log's tail
    assert "FAILED: quickstart_fp32_cuda" in result.stderr


def test_gpu_check_names_a_failed_nccl_probe(tmp_path):
    result, _ = _fake_gpu_run(tmp_path, probe_rc=1)
    assert result.returncode == 1
    assert "the NCCL all-reduce probe failed" in result.stderr and "FAILED: NCCL probe" in result.stderr


def test_nccl_probe_all_reduces_and_prints_bandwidth_on_gloo():
    """scripts/nccl_probe.py itself, for real over 2 CPU processes (gloo in place of NCCL)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "scripts/nccl_probe.py",
            "--backend",
            "gloo",
            "--mib",
            "1",
            "--warmup",
            "1",
            "--iters",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("nccl_probe:")]
    match = re.fullmatch(r"nccl_probe: world 2, 1 MiB, algbw ([\d.]+) GB/s, busbw ([\d.]+) GB/s", line)
    assert match and float(match.group(1)) > 0 and match.group(1) == match.group(2)  # 2 ranks: busbw = algbw


def test_bus_bandwidth_is_the_ring_factor():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from nccl_probe import bus_bandwidth
    finally:
        sys.path.pop(0)
    assert bus_bandwidth(100.0, 8) == 175.0 and bus_bandwidth(100.0, 2) == 100.0 and bus_bandwidth(100.0, 1) == 0.0
