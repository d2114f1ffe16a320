"""`rollout.sync.logprob_gap_threshold: auto`: per `model.dtype`, the measured gap of bit-identical
weights (benchmarks/results/extra/sync_logprob_gap.json) times the stated margin; a number overrides it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import ConfigError, SyncConfig, load_config
from megarl.config.rollout import (
    LOGPROB_GAP_BY_DTYPE,
    LOGPROB_GAP_MARGIN,
    LOGPROB_GAP_MEASURED,
    logprob_gap_threshold,
)

MEASUREMENT = Path(__file__).parents[3] / "benchmarks/results/extra/sync_logprob_gap.json"


def test_the_defaults_are_the_recorded_measurement_rounded_up():
    results = json.loads(MEASUREMENT.read_text())["results"]
    for dtype, measured in LOGPROB_GAP_MEASURED.items():
        gaps = [row["max_abs_diff"] for row in results if row["dtype"] == dtype]
        assert all(row["identical_tensors"] > 0 for row in results)  # weights proven bit-identical
        assert gaps and max(gaps) <= measured <= 1.1 * max(gaps)
        assert LOGPROB_GAP_BY_DTYPE[dtype] == LOGPROB_GAP_MARGIN * measured
    assert LOGPROB_GAP_BY_DTYPE["float32"] < LOGPROB_GAP_BY_DTYPE["bfloat16"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_follows_the_dtype_and_a_number_overrides_it(dtype):
    assert logprob_gap_threshold(SyncConfig(), dtype) == LOGPROB_GAP_BY_DTYPE[dtype]
    assert logprob_gap_threshold(SyncConfig(logprob_gap_threshold=0.3), dtype) == 0.3


def test_the_recipe_key_takes_auto_or_a_number(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  path: some/model\n")
    assert load_config(recipe).rollout.sync.logprob_gap_threshold == "auto"
    assert load_config(recipe, ["rollout.sync.logprob_gap_threshold=0.2"]).rollout.sync.logprob_gap_threshold == 0.2
    with pytest.raises(ConfigError, match="rollout.sync.logprob_gap_threshold"):
        load_config(recipe, ["rollout.sync.logprob_gap_threshold=tight"])
