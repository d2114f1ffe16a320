"""`megarl bench step --modes`: each mode's overrides give a recipe `validate` accepts, with the Megatron
roles on the recipe's devices in every mode; what the option refuses before running anything; the table."""

from pathlib import Path

import pytest

from megarl.bench.step_modes import MODES, PARTIAL_SEGMENT, markdown, mode_overrides
from megarl.cli.main import main
from megarl.config.loader import load_config
from megarl.config.validate import validate

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


@pytest.mark.parametrize(
    "base", [[], ["placement.mode=split", "placement.gpus_per_node=3", "placement.rollout_gpus=1"]]
)
def test_every_mode_is_a_valid_recipe_on_the_same_training_devices(base):
    config = load_config(QUICKSTART, base)
    expected = {
        "colocated_sync": ("colocated", 2, 0, "sync", 0, 0),
        "split_sync": ("split", 3, 1, "sync", 0, 0),
        "split_one_step_off": ("split", 3, 1, "one_step_off", 0, 0),
        "split_async": ("split", 3, 1, "async", 0, 0),
        "split_async_partial": ("split", 3, 1, "async", PARTIAL_SEGMENT, 0),
        "split_async_carry": ("split", 3, 1, "async", PARTIAL_SEGMENT, 8),  # half the quickstart's 16 prompts
    }
    for mode in MODES:
        moded = load_config(QUICKSTART, [*base, *mode_overrides(config, mode)])
        placement = moded.placement
        assert (
            placement.mode,
            placement.gpus_per_node,
            placement.rollout_gpus,
            moded.trainer.rollout_mode,
            moded.rollout.partial_rollout,
            moded.rollout.over_sampling,
        ) == expected[mode], mode
        assert moded.trainer.max_staleness == (2 if mode == "split_async_carry" else 1), mode
        assert validate(moded, check_files=False) == [], mode


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["bench", "step", "--modes", "split_sync,async"],
            "--modes 'split_sync,async': unknown async; choose among "
            "colocated_sync, split_sync, split_one_step_off, split_async, split_async_partial, split_async_carry",
        ),
        (["bench", "train", "--modes", "split_sync"], "compares whole steps of megarl alone"),
        (["bench", "step", "--modes", ""], "unknown empty list"),
        (["bench", "step", "--modes", "split_sync", "--rounds", "0"], "--rounds 0: rounds of the rollout modes, >= 1"),
        (["bench", "step", "--rounds", "2"], "--rounds 2: rounds of the rollout modes, >= 1, with --modes only"),
    ],
)
def test_modes_outside_their_benchmark_or_unknown_are_refused(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_table_gives_samples_per_second_and_the_ratio_to_split_sync():
    run = {"samples_per_step": 128, "repeats": 5, "warmup_steps": 1}
    result = {
        "config": "q.yaml",
        "baseline": "split_sync",
        "rounds": 1,
        "modes": {"split_sync": {**run, "step_seconds": 16.0}, "split_one_step_off": {**run, "step_seconds": 8.0}},
        "step_seconds_by_round": {"split_sync": [16.0], "split_one_step_off": [8.0]},
        "samples_per_s": {"split_sync": 8.0, "split_one_step_off": 16.0},
        "ratios": {"split_sync": 1.0, "split_one_step_off": 2.0},
        "seed": 0,
        "reward_rise": {"split_sync": (0.02, 0.8), "split_one_step_off": (0.03, 0.7)},
    }
    table = markdown(result)
    assert "| split_one_step_off | 8.000 | 16.00 | 2.00 | 0.030 → 0.700 |" in table and "× split_sync" in table


def test_every_mode_runs_with_the_seed_and_keeps_its_reward_curve(tmp_path, monkeypatch):
    """Issue 31, item 5: the modes run with one seed, each keeps its reward per step, the table compares its
    first and last 10 steps, and the curves are drawn (`modes_plot`)."""
    from megarl.bench import step, step_modes
    from megarl.bench.modes_plot import plot_modes

    seen = {}

    def fake_step_run(config_path, overrides, repeats):
        mode = next(o.removeprefix("trainer.rollout_mode=") for o in overrides if o.startswith("trainer.rollout_mode="))
        seen[mode] = overrides
        rewards = [0.1] * 10 + [0.5] * (repeats - 9)  # the warm-up step is the first of `repeats + 1`
        return dict(
            samples_per_step=128,
            step_seconds=2.0 if mode == "sync" else 1.0,
            step_seconds_all=[1.0] * repeats,
            per_step={"reward/mean": rewards},
            repeats=repeats,
            warmup_steps=1,
        )

    monkeypatch.setattr(step, "run", fake_step_run)
    result = step_modes.run(str(QUICKSTART), [], 40, ("split_sync", "split_async"), seed=3)
    assert all({"trainer.seed=3", "data.seed=3", "rollout.seed=3"} <= set(o) for o in seen.values())
    assert set(seen) == {"sync", "async"}
    assert result["reward_rise"] == {"split_sync": (0.1, 0.5), "split_async": (0.1, 0.5)}
    assert result["ratios"]["split_async"] == 2.0
    table = markdown(result)
    assert "seed 3" in table and "| split_async | 1.000 | 128.00 | 2.00 | 0.100 → 0.500 |" in table
    png = plot_modes(result, tmp_path / "modes.png")
    assert png.read_bytes().startswith(b"\x89PNG")


LONG_TAIL = QUICKSTART.parents[1] / "benchmarks" / "recipes" / "long_tail.yaml"


def test_the_long_tail_recipe_is_valid_in_every_mode_and_stops_on_letters_outside_the_tasks_alphabet():
    """benchmarks/recipes/long_tail.yaml (benchmarks/README.md, "The long-tail workload"): its stop ids are the
    tiny model's x, y and z, none of which the quickstart's task writes, and every mode runs it."""
    from megarl.models.tiny import build_char_tokenizer
    from megarl.rewards.tasks import REPEAT_ALPHABET

    config = load_config(LONG_TAIL)
    stops = build_char_tokenizer().convert_ids_to_tokens(list(config.rollout.stop))
    assert stops == ["x", "y", "z"] and not set(stops) & set(REPEAT_ALPHABET)
    for mode in MODES:
        assert validate(load_config(LONG_TAIL, mode_overrides(config, mode)), check_files=False) == [], mode


def test_rounds_rotate_the_modes_and_pair_the_ratios_by_round(monkeypatch):
    """`--rounds`: every mode once per round, the first mode of a round rotating, and a mode's ratio the median
    of its per-round ratios: a machine that slows down between rounds moves the step times, not the ratios."""
    from megarl.bench import step, step_modes

    order = []
    # Per round of two runs: the machine at speed 1, then 4 times slower, then 2 (async hit by a hiccup there).
    seconds = {"sync": [2.0, 8.0, 4.0], "async": [1.0, 4.0, 3.0]}

    def fake_step_run(config_path, overrides, repeats):
        mode = next(o.removeprefix("trainer.rollout_mode=") for o in overrides if o.startswith("trainer.rollout_mode="))
        order.append(mode)
        return dict(
            samples_per_step=128,
            step_seconds=seconds[mode][(len(order) - 1) // 2],
            step_seconds_all=[1.0] * repeats,
            per_step={"reward/mean": [0.1] * (repeats + 1)},
            repeats=repeats,
            warmup_steps=1,
        )

    monkeypatch.setattr(step, "run", fake_step_run)
    result = step_modes.run(str(QUICKSTART), [], 3, ("split_sync", "split_async"), rounds=3)
    assert order == ["sync", "async", "async", "sync", "sync", "async"]
    assert result["step_seconds_by_round"] == {"split_sync": [2.0, 8.0, 4.0], "split_async": [1.0, 4.0, 3.0]}
    # Paired: the median of 2, 2 and 4/3; the ratio of the medians (4 / 3) would read 1.33.
    assert result["ratios"] == {"split_sync": 1.0, "split_async": 2.0}
    assert result["samples_per_s"] == {"split_sync": 128 / 4.0, "split_async": 128 / 3.0}
    assert "3 round(s)" in markdown(result)
