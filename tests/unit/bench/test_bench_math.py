"""The arithmetic of the benchmarks (step breakdown, paired ratios, goal verdicts) on hand-made numbers."""

import pytest

from megarl.bench.common import Timings
from megarl.bench.step import breakdown


def test_other_is_the_step_minus_the_timed_phases():
    rows = [
        {"step": 2, "timing/step": 1.0, "timing/rollout": 0.5, "timing/update_actor": 0.3},
        {"step": 3, "timing/step": 2.0, "timing/rollout": 1.0, "timing/update_actor": 0.4, "timing/validation": 0.2},
        {"step": 4, "timing/step": 1.2, "timing/rollout": 0.6, "timing/update_actor": 0.3},
    ]
    result = breakdown(rows)
    assert result["step_seconds"] == 1.2
    assert result["phase_seconds"]["rollout"] == 0.6
    assert result["phase_seconds"]["validation"] == 0.0  # absent from two of three steps
    assert result["phase_seconds"]["other"] == pytest.approx(0.3)  # per step: 0.2, 0.4, 0.3
    assert result["phase_share"]["other"] == pytest.approx(0.25)


def test_paired_ratio_takes_the_median_of_per_repeat_ratios():
    timings = Timings({"a": [1.0, 10.0, 3.0], "b": [1.0, 5.0, 1.0]})
    assert timings.paired_ratio("a", "b") == 2.0
    assert timings.ratio("a", "b") == 3.0


def test_report_marks_each_goal_met_or_not():
    from megarl.bench.report import rows

    results = {
        "rollout": {"megarl_over_vllm": 1.2, "megarl_over_vllm_paired": 1.15},
        "train": {
            "megatron_over_pytorch_throughput": 0.85,
            "megatron_over_pytorch_throughput_paired": 0.9,
            "layouts": {},
        },
        "step": {"phase_share": {"other": 0.05}},
    }
    verdicts = {figure.split()[0]: goal for _, figure, _, goal in rows(results)}
    assert verdicts["megarl"] == "≤ 1.1×: NOT met"  # both ratios above the goal
    assert verdicts["Megatron"] == "≥ 0.8×: met"
    assert verdicts['"other"'] == "≤ 10 %: met"


def test_report_names_both_ratios_when_they_disagree():
    from megarl.bench.report import rows

    results = {"rollout": {"megarl_over_vllm": 1.3, "megarl_over_vllm_paired": 1.05}}
    assert rows(results)[0][3] == "≤ 1.1×: met on the paired ratio, NOT met on the medians"
