"""`megarl check-sync` input checking: bad values exit 2 with every problem named, before any
process or engine starts (bad numbers stop argument parsing: tests/unit/reliability/test_reliability_cli_arguments.py)."""

from __future__ import annotations

import argparse

from megarl.cli.check_sync import _problems, register
from megarl.cli.main import main
from megarl.models.tiny import make_tiny_model
from megarl.parallel.device import DEVICE_ENV


def test_bad_layout_and_values_exit_2_naming_each(tmp_path, capsys):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2")  # 4 heads, 2 KV heads, 2 layers
    code = main(["check-sync", "--model", str(model_dir), "--train-tp", "4", "--train-pp", "3", "--rollout-tp", "3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "train TP=4 does not divide num_key_value_heads=2" in err
    assert "train PP=3 does not divide num_hidden_layers=2" in err
    assert "rollout TP=3 does not divide num_attention_heads=4" in err


def test_virtual_stages_must_fit_the_pipeline_and_layers(tmp_path, capsys):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2")  # 2 layers
    assert main(["check-sync", "--model", str(model_dir), "--train-vpp", "2"]) == 2
    assert "train VPP=2 needs train PP > 1" in capsys.readouterr().err
    assert main(["check-sync", "--model", str(model_dir), "--train-pp", "2", "--train-vpp", "2"]) == 2
    assert "train PP=2 × VPP=2 does not divide num_hidden_layers=2" in capsys.readouterr().err
    assert main(["check-sync", "--model", str(model_dir), "--train-vpp", "0"]) == 2
    assert "--train-vpp 0: must be >= 1" in capsys.readouterr().err


def test_missing_model_exits_2(tmp_path, capsys):
    assert main(["check-sync", "--model", str(tmp_path / "nowhere")]) == 2
    assert "HF config not found" in capsys.readouterr().err


def test_in_process_transport_needs_rollout_tp_1(tmp_path, capsys):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2")
    assert main(["check-sync", "--model", str(model_dir), "--transport", "in-process", "--rollout-tp", "2"]) == 2
    assert "--rollout-tp 2 with --transport in-process" in capsys.readouterr().err


def test_collective_on_gpus_is_refused_naming_the_fix(tmp_path, capsys, monkeypatch):
    """On GPUs the collective check would put training rank 0 (LOCAL_RANK 0) and the engine's worker 0
    (vLLM's first visible GPU) in one NCCL group on GPU 0, which NCCL refuses (src/init.cc: "Duplicate
    GPU detected", ncclInvalidUsage): it exits 2 before anything starts. The device is the fact `uses_cuda`
    reads (`MEGARL_DEVICE=cuda`, as the driver hands it to workers), so no GPU is needed; in-process
    stays allowed."""
    model_dir = make_tiny_model(tmp_path / "m", "qwen2")
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert main(["check-sync", "--model", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert "--transport collective on GPUs" in err and "use --transport in-process" in err
    assert "CUDA_VISIBLE_DEVICES= megarl check-sync" in err
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    in_process = parser.parse_args(["check-sync", "--model", str(model_dir), "--transport", "in-process"])
    assert _problems(in_process) == []  # checked only: running it would start the engines


def test_expert_layouts_are_checked_against_the_model_and_the_transport(tmp_path, capsys):
    """--train-ep / --train-etp: a dense model has no experts, EP must divide them, and the colocated
    in-process check (which gathers over TP only) refuses experts split over EP ranks."""
    dense = make_tiny_model(tmp_path / "dense", "qwen2")
    assert main(["check-sync", "--model", str(dense), "--train-ep", "2"]) == 2
    assert "expert settings on a dense model" in capsys.readouterr().err
    moe = make_tiny_model(tmp_path / "moe", "qwen3_moe")  # 8 experts of width 128
    assert main(["check-sync", "--model", str(moe), "--train-etp", "0"]) == 2
    assert "--train-etp 0: must be >= 1" in capsys.readouterr().err
    assert main(["check-sync", "--model", str(moe), "--train-ep", "3"]) == 2
    assert "train EP=3 does not divide num_experts=8" in capsys.readouterr().err
    assert main(["check-sync", "--model", str(moe), "--train-ep", "2", "--transport", "in-process"]) == 2
    assert "--train-ep 2 / --train-etp None with --transport in-process" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        ["check-sync", "--model", str(moe), "--train-ep", "2", "--train-tp", "2", "--train-etp", "1"]
    )
    assert _problems(args) == []
