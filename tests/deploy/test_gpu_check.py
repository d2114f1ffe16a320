"""scripts/gpu_check.sh on this CPU machine: it runs tests/gpu, every test is reported skipped (no
CUDA), the JSON report has its schema, and the exit code is 0. On a GPU machine the same script runs
them for real (its report then goes to benchmarks/results/gpu_check.json)."""

import ast
import json
import subprocess
import sys

from deploy_support import REPO

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
        ["bash", "scripts/gpu_check.sh", "--python", sys.executable, "--report", str(report_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["device"] == {"cuda_available": False, "count": 0}
    assert REQUIRED_VERSIONS <= set(report["versions"])
    # one entry per test, or per case of a parametrized one (`name[case]`)
    assert {nodeid.split("[")[0] for nodeid in report["tests"]} == _gpu_test_ids() and len(report["tests"]) >= 4
    for entry in report["tests"].values():
        assert entry["outcome"] == "skipped" and "no CUDA device" in entry["reason"]
        assert entry["memory"] == {}
    assert report["summary"] == {"passed": 0, "failed": 0, "skipped": len(report["tests"])}
    assert "no CUDA device; 0 failed, 0 passed" in result.stdout


def test_gpu_check_refuses_an_interpreter_without_megarl(tmp_path):
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--python", "/usr/bin/false"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "cannot import megarl" in result.stderr and "--python" in result.stderr
