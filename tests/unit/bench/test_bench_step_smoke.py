"""`megarl bench step --smoke` end to end on the quickstart recipe, its workers the loop's fake cluster
(`tests/fake_cluster.py`): the result holds every figure the README table is built from, with the recorded
context. The phases are the loop's own timers (`RunningCluster`, real here); the real workers' whole job on
the quickstart recipe is tests/e2e/trainer/test_trainer_e2e.py's."""

import json
import os
from pathlib import Path

from fake_cluster import fake_cluster
from quickstart_assets import make_assets

from megarl.cli.main import main

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def test_step(tmp_path, monkeypatch):
    # The quickstart recipe, pointed at a tiny model, data and run directory of this test's own.
    assets = make_assets(tmp_path / "assets")
    recipe = (
        QUICKSTART.read_text()
        .replace("outputs/tiny-model", str(assets / "model"))
        .replace("outputs/quickstart-data", str(assets / "data"))
        .replace("outputs/", f"{tmp_path}/outputs/")
    )
    (tmp_path / "recipe.yaml").write_text(recipe)
    # What the benchmark sets for its Ray workers (setdefault): set here, so the process's environment is restored after.
    monkeypatch.setitem(os.environ, "RAY_worker_niceness", "0")
    out = tmp_path / "step.json"
    with fake_cluster(monkeypatch):
        args = [
            "bench",
            "step",
            "--smoke",
            "--repeats",
            "2",
            "--json",
            str(out),
            "--config",
            str(tmp_path / "recipe.yaml"),
        ]
        assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "step"
    assert result["context"]["versions"]["torch"]
    assert result["model"]["parameters"] > 0
    assert result["repeats"] == 2
    assert result["samples_per_step"] == 16  # --smoke: 4 prompts, 4 samples each
    # The quickstart's update is exactly on-policy: no old-log-prob pass of its own.
    assert {"rollout", "update_actor", "sync", "other"} <= set(result["phase_seconds"])
    assert "old_log_prob" not in result["phase_seconds"]
    assert result["phase_seconds"]["other"] < result["step_seconds"]
