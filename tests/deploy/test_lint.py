"""The lint lane: ruff (lint and format) and mypy over the Python, shellcheck over every script in scripts/,
hadolint over both Dockerfiles, and the conventions of the deployment scripts (strict mode, --help).

ruff and mypy read their settings from pyproject.toml ([tool.ruff], [tool.mypy]); .pre-commit-config.yaml
runs the same three commands on the staged files."""

import subprocess

import pytest
import yaml
from deploy_support import REPO, VENV_BIN

SCRIPTS = sorted([*REPO.glob("scripts/**/*.sh"), *REPO.glob("scripts/**/*.sbatch")])
DEPLOY_SCRIPTS = [
    "scripts/ray_head.sh",
    "scripts/ray_worker.sh",
    "scripts/submit.sh",
    "scripts/stop.sh",
    "scripts/slurm/megarl.sbatch",
]
DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.cpu"]


def _tool(name: str) -> str:
    path = VENV_BIN / name
    if not path.exists():
        pytest.fail(f"{name} not found in {VENV_BIN}: install the dev extra (pip install -e .[dev])", pytrace=False)
    return str(path)


def _report(command: list[str], result: subprocess.CompletedProcess, fix: str) -> str:
    """A failure message: the command, what it found, and how to fix it."""
    found = (result.stdout + result.stderr).strip()
    return f"`{' '.join(command)}` exited {result.returncode}:\n{found}\n\nfix: {fix}"


def test_ruff_check_clean():
    command = [_tool("ruff"), "check", "--output-format=concise", "--no-cache", "."]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, _report(
        command,
        result,
        ".venv/bin/ruff check --fix (then fix by hand what it cannot; the rules: pyproject.toml [tool.ruff.lint])",
    )


def test_ruff_format_clean():
    command = [_tool("ruff"), "format", "--check", "--output-format=concise", "--no-cache", "."]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, _report(command, result, ".venv/bin/ruff format (it rewrites the files listed)")


def test_mypy_clean():
    """The pure packages type-check (pyproject.toml [tool.mypy] names the files). ~15 s of CPU cold; mypy's
    cache (.mypy_cache, git-ignored; it rechecks what changed) makes a rerun take about a second."""
    command = [_tool("mypy")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, _report(
        command, result, "correct the types it names (`.venv/bin/mypy` reruns it with the same settings)"
    )


def test_pre_commit_runs_the_lint_lane_with_the_venvs_tools():
    """The hooks are valid for pre-commit and call this lane's three tools from .venv (no download at commit)."""
    command = [_tool("pre-commit"), "validate-config", ".pre-commit-config.yaml"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, _report(command, result, "correct .pre-commit-config.yaml")
    repos = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())["repos"]
    assert [repo["repo"] for repo in repos] == ["local"]
    hooks = [hook for repo in repos for hook in repo["hooks"]]
    assert [hook["entry"].split()[:2] for hook in hooks] == [
        [".venv/bin/ruff", "check"],
        [".venv/bin/ruff", "format"],
        [".venv/bin/mypy"],
    ]


def test_every_deploy_script_is_linted():
    assert {str(path.relative_to(REPO)) for path in SCRIPTS} >= set(DEPLOY_SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(path.relative_to(REPO)) for path in SCRIPTS])
def test_shellcheck_clean(script):
    result = subprocess.run(
        [_tool("shellcheck"), "--shell=bash", "--external-sources", str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_clean(dockerfile):
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", dockerfile], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", DEPLOY_SCRIPTS)
def test_strict_mode_and_help(script):
    assert "set -euo pipefail" in (REPO / script).read_text()
    result = subprocess.run(["bash", script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("Usage:"), result.stdout + result.stderr
    bad = subprocess.run(["bash", script, "--no-such-option"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr, bad.stdout + bad.stderr
