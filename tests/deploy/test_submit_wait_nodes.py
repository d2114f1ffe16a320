"""`scripts/submit.sh --wait-nodes N` counts the cluster's alive nodes as Ray 2.60's `ray list nodes --format
json` prints them: the whole list on one line (found on the first two-host run, issue 32 item 12: counting
lines saw one node of two and waited out its timeout). A stand-in `ray` on PATH answers `list nodes` with
that one-line JSON and `job submit` with success."""

import json
import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_RAY = """#!/usr/bin/env bash
if [ "$1 $2" = "list nodes" ]; then
  printf '%s\\n' "$FAKE_RAY_NODES"
  exit 0
fi
[ "$1 $2" = "job submit" ] && exit 0
exit 3
"""


def submit(tmp_path: Path, nodes: int, wait_nodes: int) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    ray = bin_dir / "ray"
    ray.write_text(FAKE_RAY)
    ray.chmod(ray.stat().st_mode | stat.S_IEXEC)
    listing = json.dumps(
        [{"node_id": f"{i:056x}", "node_ip": f"10.0.0.{i + 1}", "state": "ALIVE"} for i in range(nodes)]
    )
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_RAY_NODES": listing}
    return subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "submit.sh"),
            "--wait-nodes",
            str(wait_nodes),
            "--wait-timeout",
            "3",
            "--working-dir",
            str(tmp_path),
            "--",
            "true",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_two_nodes_on_one_line_count_as_two(tmp_path):
    done = submit(tmp_path, nodes=2, wait_nodes=2)
    assert done.returncode == 0, done.stderr
    assert "submit.sh: 2 node(s) alive." in done.stdout


def test_one_node_of_two_waits_out_its_timeout_naming_the_count(tmp_path):
    done = submit(tmp_path, nodes=1, wait_nodes=2)
    assert done.returncode == 1
    assert "did not reach 2 alive node(s) within 3s (has 1)" in done.stderr
