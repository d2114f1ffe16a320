"""shellcheck over every script in scripts/, hadolint over both Dockerfiles, and the conventions of the
deployment scripts (strict mode, --help)."""

import subprocess

import pytest
from deploy_support import REPO, VENV_BIN

SCRIPTS = sorted([*REPO.glob("scripts/**/*.sh"), *REPO.glob("scripts/**/*.sbatch")])
DEPLOY_SCRIPTS = ["scripts/ray_head.sh", "scripts/ray_worker.sh", "scripts/submit.sh", "scripts/stop.sh",
                  "scripts/slurm/megarl.sbatch"]
DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.cpu"]


def _tool(name: str) -> str:
    path = VENV_BIN / name
    if not path.exists():
        pytest.fail(f"{name} not found in {VENV_BIN}: install the dev extra (pip install -e .[dev])", pytrace=False)
    return str(path)


def test_every_deploy_script_is_linted():
    assert {str(path.relative_to(REPO)) for path in SCRIPTS} >= set(DEPLOY_SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(path.relative_to(REPO)) for path in SCRIPTS])
def test_shellcheck_clean(script):
    result = subprocess.run([_tool("shellcheck"), "--shell=bash", "--external-sources", str(script)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_clean(dockerfile):
    result = subprocess.run([_tool("hadolint"), "--no-color", dockerfile], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", DEPLOY_SCRIPTS)
def test_strict_mode_and_help(script):
    assert "set -euo pipefail" in (REPO / script).read_text()
    result = subprocess.run(["bash", script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("Usage:"), result.stdout + result.stderr
    bad = subprocess.run(["bash", script, "--no-such-option"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr, bad.stdout + bad.stderr
