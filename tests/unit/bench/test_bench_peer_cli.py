"""`megarl bench step --peer trl`: what it refuses before running anything (exit 2, one line naming the
argument and the fix), and the table it writes from a result, contenders that failed included."""

import importlib.util

import pytest

from megarl.bench.peer import markdown
from megarl.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["bench", "train", "--peer", "trl"], "--peer trl compares whole steps only; use megarl bench step --peer trl"),
    (["bench", "step", "--peer", "trl", "--model", "."], "the comparison makes its own model"),
])
def test_a_peer_outside_its_benchmark_is_refused(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_missing_trl_is_one_error_naming_the_bench_extra(monkeypatch, capsys):
    """Without TRL (it is an optional extra) the command stops before making the model or starting Ray."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a))
    assert main(["bench", "step", "--peer", "trl"]) == 2
    err = capsys.readouterr().err
    assert "needs TRL" in err and "megarl[bench]" in err and "Traceback" not in err


def test_unknown_peer_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "step", "--peer", "openrlhf"])
    assert exit_.value.code == 2 and "invalid choice: 'openrlhf'" in capsys.readouterr().err


def test_the_table_shows_each_contender_its_ratio_and_a_failure_with_its_last_error_line():
    result = {
        "model": {"parameters": 23.7e6}, "workload": {"prompts_per_step": 16, "samples_per_prompt": 8,
                                                       "max_new_tokens": 64},
        "measured_steps": 3,
        "contenders": {
            "megarl": {"step_seconds": 10.0, "launch_to_end_seconds": 80.0, "update_mfu": 0.25, "peak_tflops": 0.04},
            "megarl_bf16": {"step_seconds": 4.0, "launch_to_end_seconds": 90.0, "update_mfu": 0.26, "peak_tflops": 0.04},
            "trl": {"step_seconds": 8.0, "launch_to_end_seconds": 50.0},
            "trl_vllm": {"error": "Traceback ...\n[rank0]: RuntimeError: no engine\n  0%|   | 0/2 [00:08<?, ?it/s]\n", "launch_to_end_seconds": 9.0},
        },
        "megarl_over_peer_step_ratio": {"megarl/trl": 1.25, "megarl_bf16/trl": 0.5},
    }
    table = markdown(result)
    assert "| system | s/step | megarl ÷ system | megarl_bf16 ÷ system | launch→end s |" in table
    assert "| trl | 8.00 | 1.25 | 0.50 | 50 |" in table
    assert "| megarl | 10.00 | — | — | 80 |" in table
    assert "| trl_vllm | failed: RuntimeError: no engine | — | — | 9 |" in table
    assert "megarl's actor update: MFU 25.0% of a 40.0 GFLOP/s measured matmul peak" in table
    assert "megarl_bf16's actor update: MFU 26.0%" in table
