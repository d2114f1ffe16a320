"""Offline W&B runs in tests: the real client, no network, no login, and the run read back with W&B's
own reader of its `.wandb` transaction log, `wandb leet inspect --json` (wandb/cli/leet.py: one JSON
object per record; with `--summary`, the run's state, config and latest values as one object).

    use_offline_wandb(monkeypatch, tmp_path / "wandb-home")
    ...  # a MetricsLogger with "wandb" writes run_dir/wandb/offline-run-<time>-<id>/
    [run] = offline_runs(run_dir)
    history(run)     # [(step, {"reward/mean": 0.5, ...}), ...]
"""

import json
import subprocess
import sys
from pathlib import Path

import psutil


def use_offline_wandb(monkeypatch, home: Path) -> None:
    """Offline mode, W&B's settings and caches under `home`, no API key from the caller's environment."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for variable, folder in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(variable, str(home / folder))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def offline_runs(run_dir: Path) -> list[Path]:
    """The offline W&B run directories under a megarl run directory, oldest first (one per start)."""
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def inspect(wandb_run: Path, *options: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", *options, str(wandb_run)],
        check=True,
        capture_output=True,
        text=True,
    )
    return result.stdout


def records(wandb_run: Path) -> list[dict]:
    """Every record of the run's `.wandb` file, in order."""
    return [json.loads(line) for line in inspect(wandb_run).splitlines()]


def summary(wandb_run: Path) -> dict:
    """The run's state, run id, config and latest values."""
    return json.loads(inspect(wandb_run, "--summary"))


def history(wandb_run: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) of each logged step, without W&B's own `_runtime`/`_step`/`_timestamp`."""
    return [
        (
            record["history"]["step"]["num"],
            {name: value for name, value in record["history"]["item"].items() if not name.startswith("_")},
        )
        for record in records(wandb_run)
        if record["type"] == "history"
    ]


def wandb_processes() -> list[psutil.Process]:
    """W&B's service and system-monitor processes started by this process (`wandb-core`, `wandb-symon`)."""
    return [child for child in psutil.Process().children(recursive=True) if child.name().startswith("wandb")]
