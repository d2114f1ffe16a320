"""`rollout.sync.logprob_gap_threshold: auto`: per (`model.dtype`, rollout dtype), the measured gap of bit-identical
weights (benchmarks/results/extra/sync_logprob_gap.json) times the stated margin; a number overrides it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config.loader import load_config
from megarl.config.problems import ConfigError
from megarl.config.rollout import (
    LOGPROB_GAP_BY_DTYPE,
    LOGPROB_GAP_MARGIN,
    LOGPROB_GAP_MEASURED,
    SyncConfig,
    logprob_gap_threshold,
    rollout_dtype,
)

MEASUREMENT = Path(__file__).parents[3] / "benchmarks/results/extra/sync_logprob_gap.json"


def test_the_defaults_are_the_recorded_measurement_rounded_up():
    results = json.loads(MEASUREMENT.read_text())["results"]
    for (dtype, engine_dtype), measured in LOGPROB_GAP_MEASURED.items():
        gaps = [row["max_abs_diff"] for row in results if (row["dtype"], row["rollout_dtype"]) == (dtype, engine_dtype)]
        assert all(row["identical_tensors"] > 0 for row in results)  # weights proven bit-identical
        assert gaps and max(gaps) <= measured <= 1.1 * max(gaps)
        assert LOGPROB_GAP_BY_DTYPE[(dtype, engine_dtype)] == LOGPROB_GAP_MARGIN * measured
    assert LOGPROB_GAP_BY_DTYPE[("float32", "float32")] < LOGPROB_GAP_BY_DTYPE[("float32", "bfloat16")]


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")])
def test_auto_follows_the_dtypes_and_a_number_overrides_it(dtypes):
    assert logprob_gap_threshold(SyncConfig(), *dtypes) == LOGPROB_GAP_BY_DTYPE[dtypes]
    assert logprob_gap_threshold(SyncConfig(logprob_gap_threshold=0.3), *dtypes) == 0.3


def test_the_rollout_dtype_follows_the_model_unless_set(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  path: some/model\n  dtype: float32\n")
    assert rollout_dtype(load_config(recipe).rollout, "float32") == "float32"
    assert rollout_dtype(load_config(recipe, ["rollout.dtype=bfloat16"]).rollout, "float32") == "bfloat16"
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(recipe, ["rollout.dtype=float16"])


def test_the_recipe_key_takes_auto_or_a_number(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  path: some/model\n")
    assert load_config(recipe).rollout.sync.logprob_gap_threshold == "auto"
    assert load_config(recipe, ["rollout.sync.logprob_gap_threshold=0.2"]).rollout.sync.logprob_gap_threshold == 0.2
    with pytest.raises(ConfigError, match="rollout.sync.logprob_gap_threshold"):
        load_config(recipe, ["rollout.sync.logprob_gap_threshold=tight"])


def test_fp32_engines_beside_a_bf16_actor_are_refused(tmp_path):
    """They would hold bf16-rounded weights in twice the memory, no more precise: `validate` says so."""
    from megarl.config.validate import validate

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  path: some/model\n  dtype: bfloat16\n")
    problems = validate(load_config(recipe, ["rollout.dtype=float32"]), check_files=False)
    assert [p for p in problems if p.key == "rollout.dtype" and "use auto (the model's dtype) or bfloat16" in str(p)]
    assert not [
        p
        for p in validate(load_config(recipe, ["rollout.dtype=bfloat16"]), check_files=False)
        if p.key == "rollout.dtype"
    ]
