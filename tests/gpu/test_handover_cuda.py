"""The hand-over on one GPU (`megarl.cluster.handover`): the quickstart recipe in bf16 with the actor
offloading parameters, gradients and optimizer state, colocated with a vLLM engine that sleeps at
level 2. Each phase's memory metric must show the side that is idle holding less than when it works.
CPU twin: tests/e2e/trainer/test_trainer_e2e.py (the calls happen and are measured, RSS per phase)
and tests/unit/cluster/test_handover.py (the order over fake workers)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
MEGARL = [sys.executable, "-m", "megarl.cli.main"]
STEPS = 4


@pytest.fixture(scope="module")
def run_metrics(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("handover")
    subprocess.run(MEGARL + ["init-tiny-model", "--out", str(root / "model")], check=True)
    subprocess.run(MEGARL + ["make-data", "--task", "repeat_first_char", "--out", str(root / "data")], check=True)
    run_dir = root / "run"
    overrides = {
        "model.path": root / "model",
        "model.dtype": "bfloat16",
        "data.train_files": f"[{root / 'data' / 'train.jsonl'}]",
        "data.val_files": f"[{root / 'data' / 'val.jsonl'}]",
        "trainer.device": "cuda",
        "trainer.total_steps": STEPS,
        "trainer.test_freq": 0,
        "trainer.output_dir": run_dir,
        "placement.gpus_per_node": 1,
        "actor.parallel.tensor_model_parallel_size": 1,
        "actor.offload.params": "true",
        "actor.offload.grads": "true",
        "actor.offload.optimizer": "true",
        "rollout.sleep_level": 2,
        "rollout.gpu_memory_utilization": 0.3,
        "checkpoint.dir": run_dir / "checkpoints",
        "checkpoint.save_freq": 0,
        "checkpoint.export_hf": "false",
    }
    result = subprocess.run(
        MEGARL
        + ["train", str(REPO / "configs" / "quickstart.yaml"), *(f"{key}={value}" for key, value in overrides.items())],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = (run_dir / "quickstart" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_every_step_trains_with_the_handover(run_metrics):
    assert len(run_metrics) == STEPS
    assert all(step["sync/logprob_max_abs_diff"] <= 0.05 for step in run_metrics)


def test_the_actor_releases_what_it_offloads(run_metrics):
    for step in run_metrics:
        trained = step["memory/actor/trained/allocated_gib"]
        assert step["memory/actor/training_offloaded/allocated_gib"] < trained
        assert (
            step["memory/actor/params_offloaded/allocated_gib"] < step["memory/actor/training_offloaded/allocated_gib"]
        )


def test_sleeping_engines_free_the_device(run_metrics):
    for step in run_metrics:
        awake = step["memory/rollout/generated/device_used_gib"]
        assert step["memory/rollout/asleep/device_used_gib"] < awake
        assert step["memory/rollout/weights_awake/device_used_gib"] < step["memory/rollout/awake/device_used_gib"]
