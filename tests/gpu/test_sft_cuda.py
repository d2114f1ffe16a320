"""`megarl sft` on one GPU in bf16 (Transformer Engine layer spec where `auto` finds it): the loss falls and
the export loads in transformers. CPU twin: tests/e2e/trainer/test_sft_e2e.py."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
MEGARL = [sys.executable, "-m", "megarl.cli.main"]


def test_sft_on_cuda_in_bf16(tmp_path, memory_phase):
    subprocess.run(MEGARL + ["init-tiny-model", "--tool-tokens", "--out", str(tmp_path / "model")], check=True)
    subprocess.run(
        MEGARL
        + [
            "make-data",
            "--task",
            "calc_tool_demos",
            "--out",
            str(tmp_path / "data"),
            "--n-train",
            "256",
            "--n-val",
            "8",
        ],
        check=True,
    )
    overrides = {
        "model.path": tmp_path / "model",
        "model.dtype": "bfloat16",
        "train.device": "cuda",
        "train.gpus": 1,
        "data.train_files": f"[{tmp_path / 'data' / 'train.jsonl'}]",
        "train.epochs": 2,
        "train.output_dir": tmp_path / "out",
    }
    with memory_phase("sft"):
        result = subprocess.run(
            MEGARL
            + ["sft", str(REPO / "configs" / "sft_tiny.yaml"), *(f"{key}={value}" for key, value in overrides.items())],
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    losses = [float(loss) for loss in re.findall(r"^sft step \d+/32 \| loss ([0-9.]+)", result.stdout, re.MULTILINE)]
    assert len(losses) == 32 and losses[-1] < 0.5 * losses[0], losses  # 256 ÷ 16 per step × 2 epochs
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.vocab_size == 104 and all(torch.isfinite(p).all() for p in model.parameters())
