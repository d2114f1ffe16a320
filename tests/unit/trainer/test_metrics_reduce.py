"""Metric names, the reducer, the pure metric helpers and the phase timer."""

import math

import pytest

from megarl.cluster.metric_reduce import reduce_metrics
from megarl.cluster.timing import PHASES, STARTUP_PHASES, PhaseTimer, startup_line
from megarl.trainer.metrics import (
    DOCUMENTED_METRICS,
    rollout_metrics,
    throughput_metrics,
    undocumented,
    update_mfu_metrics,
    worker_metrics,
)


def test_reduce_means_by_default_and_sums_maxes_mins_the_documented_exceptions():
    ranks = [
        {
            "actor/entropy": 1.0,
            "reward/errors": 1.0,
            "sync/logprob_max_abs_diff": 2e-7,
            "timing/rollout": 3.0,
            "response_length/min": 4.0,
        },
        {
            "actor/entropy": 3.0,
            "reward/errors": 2.0,
            "sync/logprob_max_abs_diff": 5e-7,
            "timing/rollout": 1.0,
            "response_length/min": 2.0,
        },
    ]
    assert reduce_metrics(ranks) == {
        "actor/entropy": 2.0,
        "reward/errors": 3.0,
        "sync/logprob_max_abs_diff": 5e-7,
        "timing/rollout": 3.0,
        "response_length/min": 2.0,
    }


def test_reduce_uses_the_dicts_that_have_a_name_and_propagates_nan():
    reduced = reduce_metrics([{"actor/loss": 1.0, "reward/max": math.nan}, {"reward/max": 2.0}, {"actor/loss": 3.0}])
    assert reduced["actor/loss"] == 2.0
    assert math.isnan(reduced["reward/max"])


def test_rollout_metrics_of_a_step():
    metrics = rollout_metrics([1.0, 0.0, 1.0, 0.0], [3, 8, 8, 5], max_response_length=8, prompt_lengths=[2, 4, 2, 4])
    assert metrics == {
        "reward/mean": 0.5,
        "reward/std": 0.5,
        "reward/max": 1.0,
        "reward/min": 0.0,
        "response_length/mean": 6.0,
        "response_length/max": 8.0,
        "response_length/min": 3.0,
        "response_length/clip_ratio": 0.5,
        "prompt_length/mean": 3.0,
    }


def test_throughput():
    assert throughput_metrics(total_tokens=600, step_seconds=2.0) == {
        "perf/total_tokens": 600.0,
        "perf/tokens_per_s": 300.0,
    }


def test_update_mfu_is_the_updates_model_flop_rate_over_the_peak():
    """3e12 model FLOPs in 1.5 s on a 4 TFLOP/s group: 2 TFLOP/s achieved, half the peak."""
    assert update_mfu_metrics(update_flops=3e12, update_seconds=1.5, peak_flops=4e12) == {
        "perf/update_tflops": 2.0,
        "perf/peak_tflops": 4.0,
        "perf/mfu": 0.5,
    }


def test_worker_results_get_logged_names_and_unknown_keys_are_refused():
    assert worker_metrics("actor", {"clip_frac": 0.1, "approx_kl": 0.01, "kl_loss": 0.2}) == {
        "actor/pg_clipfrac": 0.1,
        "actor/ppo_kl": 0.01,
        "actor/kl": 0.2,
    }
    assert worker_metrics("critic", {"loss": 0.5}) == {"critic/vf_loss": 0.5}
    with pytest.raises(KeyError, match="new_metric"):
        worker_metrics("actor", {"new_metric": 1.0})
    assert worker_metrics("actor", {"moe_layer_3_load_cv": 0.2, "moe_aux_loss": 1.1}) == {
        "actor/moe/layer_3/load_cv": 0.2,
        "actor/moe/aux_loss": 1.1,
    }
    with pytest.raises(KeyError, match="moe_layer_3_load_median"):
        worker_metrics("actor", {"moe_layer_3_load_median": 1.0})


def test_every_produced_name_is_documented():
    produced = {
        *rollout_metrics([1.0], [1], 1, [1]),
        *throughput_metrics(1, 1.0),
        *update_mfu_metrics(1.0, 1.0, 1.0),
        *(f"timing/{phase}" for phase in PHASES),
        *worker_metrics(
            "actor",
            dict.fromkeys(
                [
                    "loss",
                    "pg_loss",
                    "kl_loss",
                    "entropy",
                    "clip_frac",
                    "clip_frac_lower",
                    "approx_kl",
                    "grad_norm",
                    "lr",
                    "tokens",
                    "steps",
                    "skipped_steps",
                    "moe_aux_loss",
                    "moe_z_loss",
                    "moe_layer_0_load_max",
                    "moe_layer_47_tokens_per_expert",
                ],
                0.0,
            ),
        ),
        *worker_metrics(
            "critic",
            dict.fromkeys(
                ["loss", "clip_frac", "vpred_mean", "grad_norm", "lr", "tokens", "steps", "skipped_steps"], 0.0
            ),
        ),
        "sync/logprob_max_abs_diff",
        "sync/logprob_mean_abs_diff",
        "sync/weight_version",
        "step",
    }
    assert undocumented(produced) == []
    assert undocumented(["reward/mean", "made/up", "actor/moe/layer_x/load_max"]) == [
        "actor/moe/layer_x/load_max",
        "made/up",
    ]
    assert all(meaning.strip() for meaning in DOCUMENTED_METRICS.values())


def test_phase_timer_accumulates_per_phase_and_resets_on_pop():
    ticks = iter([0.0, 1.0, 1.5, 2.0, 2.25, 10.0])
    timer = PhaseTimer(clock=lambda: next(ticks))
    with timer("step"):  # 0.0 .. 10.0
        with timer("rollout"):  # 1.0 .. 1.5
            pass
        with timer("rollout"):  # 2.0 .. 2.25
            pass
    assert timer.pop() == {"timing/step": 10.0, "timing/rollout": 0.75}
    assert timer.pop() == {}


def test_phase_timer_records_the_time_of_a_failing_phase_and_refuses_unknown_phases():
    timer = PhaseTimer()
    with pytest.raises(RuntimeError):
        with timer("reward"):
            raise RuntimeError("reward function crashed")
    assert set(timer.pop()) == {"timing/reward"}
    with pytest.raises(ValueError, match="unknown timing phase 'generate'"):
        with timer("generate"):
            pass


def test_phase_timer_keeps_the_phases_a_failure_left_until_the_next_step():
    timer = PhaseTimer()
    with pytest.raises(RuntimeError):
        with timer("step"):
            with timer("update_actor"):
                raise RuntimeError("a rank failed")
    assert timer.active == [] and timer.failed_in == ["step", "update_actor"]
    with timer("step"):
        pass
    assert timer.failed_in is None


def test_the_startup_timer_has_its_own_phases_and_one_line_in_start_order():
    ticks = iter([0.0, 2.0, 2.0, 2.5, 3.0, 10.0])
    startup = PhaseTimer(clock=lambda: next(ticks), phases=STARTUP_PHASES)
    for phase in ("ray", "reward", "megatron"):  # entered out of start order
        with startup(phase):
            pass
    assert startup_line(startup.pop()) == "start-up 9.5 s: reward 0.5 s | ray 2.0 s | megatron 7.0 s"
    with pytest.raises(ValueError, match="unknown timing phase 'rollout'"):
        with startup("rollout"):  # a step's phase is not a start-up phase
            pass
