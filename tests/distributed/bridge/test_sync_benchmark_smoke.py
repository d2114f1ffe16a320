"""The sync benchmark at tiny size, run as its users run it (`python -m benchmarks.sync`): it
finishes, every received tensor equals the checkpoint (checked inside the benchmark, which fails
otherwise), and the JSON report adds up. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_benchmark_runs_at_tiny_size(tmp_path):
    out = tmp_path / "sync.json"
    command = [
        sys.executable, "-m", "benchmarks.sync", "--hidden-size", "128", "--num-layers", "2", "--intermediate-size", "256",
        "--bucket-mb", "0.05", "4", "--repeats", "1", "--out", str(out),
    ]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = json.loads(out.read_text())
    small, large = report["results"]
    assert [small["bucket_mb"], large["bucket_mb"]] == [0.05, 4]
    assert small["gigabytes"] == large["gigabytes"] == report["parameters"] * 4 / 1e9
    assert small["buckets"] > large["buckets"] == 1
    assert all(r["sync_seconds"] > 0 and r["clone_seconds"] > 0 and r["peak_extra_megabytes"] > 0 for r in report["results"])
    assert finished.stdout.count("\n| ") == 1 + len(report["results"])  # header rule + one row each
