"""The whole path on one GPU: `megarl check-sync --transport in-process` (a Megatron actor trains, its
shards reach the vLLM engine in its own process on its own GPU, the engine's log-probs match; the
collective transport is refused on GPUs, where it would put training rank 0 and the engine's worker 0
in one NCCL group on GPU 0: tests/unit/bridge/test_check_sync_cli.py) and a short GRPO run of the quickstart recipe with
`trainer.device=cuda` in bf16, colocated on the one GPU (weights by CUDA IPC: `rollout.sync.transport:
auto` on colocated GPUs, the engine worker reading the ring of the trainer rank on its GPU). CPU twins: tests/e2e/bridge (check-sync) and
tests/e2e/trainer/test_trainer_e2e.py."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
MEGARL = [sys.executable, "-m", "megarl.cli.main"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu_assets")
    subprocess.run(MEGARL + ["init-tiny-model", "--out", str(root / "model")], check=True)
    subprocess.run(MEGARL + ["make-data", "--task", "repeat_first_char", "--out", str(root / "data")], check=True)
    return root


def test_check_sync_in_process_on_one_gpu(assets, memory_phase):
    with memory_phase("check_sync"):
        result = subprocess.run(
            MEGARL + ["check-sync", "--model", str(assets / "model"), "--rounds", "2", "--transport", "in-process"],
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("OK")


def test_grpo_quickstart_on_cuda_in_bf16(assets, tmp_path, memory_phase):
    run_dir = tmp_path / "run"
    overrides = {
        "model.path": assets / "model",
        "model.dtype": "bfloat16",
        "data.train_files": f"[{assets / 'data' / 'train.jsonl'}]",
        "data.val_files": f"[{assets / 'data' / 'val.jsonl'}]",
        "trainer.device": "cuda",
        "trainer.total_steps": 8,
        "trainer.test_freq": 0,
        "trainer.output_dir": run_dir,
        "placement.gpus_per_node": 1,
        "actor.parallel.tensor_model_parallel_size": 1,
        "checkpoint.dir": run_dir / "checkpoints",
        "checkpoint.save_freq": 0,
        "checkpoint.export_hf": "false",
        "rollout.gpu_memory_utilization": 0.3,
    }
    args = [f"{key}={value}" for key, value in overrides.items()]
    with memory_phase("train"):
        result = subprocess.run(
            MEGARL + ["train", str(REPO / "configs" / "quickstart.yaml"), *args],
            capture_output=True,
            text=True,
            timeout=1500,
        )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    metrics = [json.loads(line) for line in (run_dir / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 8
    for step in metrics:
        assert math.isfinite(step["actor/loss"]) and math.isfinite(step["reward/mean"])
        assert step["sync/logprob_max_abs_diff"] <= 0.05  # checked every step (quickstart verify_every 1)
