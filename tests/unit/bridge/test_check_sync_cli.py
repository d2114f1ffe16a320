"""`megarl check-sync` input checking: bad values exit 2 with every problem named, before any
process or engine starts (bad numbers stop argument parsing: tests/unit/reliability/test_reliability_cli_arguments.py)."""

from __future__ import annotations

from megarl.cli.main import main
from megarl.models.tiny import make_tiny_model


def test_bad_layout_and_values_exit_2_naming_each(tmp_path, capsys):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2")  # 4 heads, 2 KV heads, 2 layers
    code = main(["check-sync", "--model", str(model_dir), "--train-tp", "4", "--train-pp", "3", "--rollout-tp", "3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "train TP=4 does not divide num_key_value_heads=2" in err
    assert "train PP=3 does not divide num_hidden_layers=2" in err
    assert "rollout TP=3 does not divide num_attention_heads=4" in err


def test_missing_model_exits_2(tmp_path, capsys):
    assert main(["check-sync", "--model", str(tmp_path / "nowhere")]) == 2
    assert "HF config not found" in capsys.readouterr().err


def test_in_process_transport_needs_rollout_tp_1(tmp_path, capsys):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2")
    assert main(["check-sync", "--model", str(model_dir), "--transport", "in-process", "--rollout-tp", "2"]) == 2
    assert "--rollout-tp 2 with --transport in-process" in capsys.readouterr().err
