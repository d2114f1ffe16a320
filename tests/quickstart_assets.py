"""The quickstart's tiny model and data, made by the CLI in-process, and the overrides that point the quickstart
recipe at them and at a private run directory (the e2e trainer tests and the fake-cluster loop tests).

    assets = make_assets(tmp_path)                       # model/, data/train.jsonl, data/val.jsonl
    Trainer.from_config(QUICKSTART, overrides(assets, tmp_path / "run", **{"trainer.total_steps": 4}))
"""

import json
from pathlib import Path

from megarl.cli.main import main


def make_assets(root: Path) -> Path:
    """`megarl init-tiny-model` and `megarl make-data --task repeat_first_char` into `root` (a subprocess per
    command would only add an interpreter start)."""
    assert main(["init-tiny-model", "--out", str(root / "model")]) == 0
    assert main(["make-data", "--task", "repeat_first_char", "--out", str(root / "data")]) == 0
    return root


def overrides(assets: Path, run_dir: Path, **extra) -> list[str]:
    """Quickstart overrides that point at `assets` and a private `run_dir`, validation off; `extra` wins."""
    values = {
        "model.path": assets / "model",
        "data.train_files": f"[{assets / 'data' / 'train.jsonl'}]",
        "data.val_files": f"[{assets / 'data' / 'val.jsonl'}]",
        "trainer.output_dir": run_dir,
        "checkpoint.dir": run_dir / "checkpoints",
        "trainer.test_freq": 0,
    } | extra
    return [f"{key}={value}" for key, value in values.items()]


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl."""
    return [json.loads(line) for line in path.read_text().splitlines()]
