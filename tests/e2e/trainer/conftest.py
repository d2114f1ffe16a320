"""A tiny model and the quickstart task data, made once for the trainer tests."""

import json
from pathlib import Path

import pytest

from megarl.cli.main import main

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trainer_assets")
    # The CLI's commands, run in this process: a subprocess per command only added an interpreter start.
    assert main(["init-tiny-model", "--out", str(root / "model")]) == 0
    assert main(["make-data", "--task", "repeat_first_char", "--out", str(root / "data")]) == 0
    return root


def overrides(assets: Path, run_dir: Path, **extra) -> list[str]:
    """Quickstart overrides that point at the test's model, data and a private run dir."""
    values = {
        "model.path": assets / "model",
        "data.train_files": f"[{assets / 'data' / 'train.jsonl'}]",
        "data.val_files": f"[{assets / 'data' / 'val.jsonl'}]",
        "trainer.output_dir": run_dir,
        "checkpoint.dir": run_dir / "checkpoints",
        "checkpoint.export_hf": "true",
        "trainer.test_freq": 0,
    } | extra
    return [f"{key}={value}" for key, value in values.items()]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
