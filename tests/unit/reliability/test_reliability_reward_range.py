"""A reward the trainer cannot hold (NaN, inf, or beyond float32's range, which float32 turns into
inf and GRPO into NaN advantages) stops the run at scoring, like any other bad result, with a message
naming the function, the value, the sample's place in the batch and the response it scored."""

import math

import pytest
import torch

from megarl.rewards.functions import FLOAT32_MAX, RewardFunctionError, checked_scores
from megarl.rewards.scorer import RewardScorer

SPEC = "reliability_range_reward:score"


@pytest.fixture
def range_module(tmp_path, monkeypatch):
    """`score` gives 1.0 to every response but the one equal to "big", which gets float(prompt)."""
    (tmp_path / "reliability_range_reward.py").write_text(
        "def score(prompts, responses, **columns):\n"
        "    return [float(p) if r == 'big' else 1.0 for p, r in zip(prompts, responses)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the scorer hands sys.path to its workers as PYTHONPATH
    return SPEC


def test_float32_max_is_torchs():
    assert FLOAT32_MAX == torch.finfo(torch.float32).max


@pytest.mark.parametrize("value", [1e39, -1e39, 10**40, math.inf, -math.inf, math.nan])
def test_a_value_float32_cannot_hold_is_rejected(value):
    with pytest.raises(RewardFunctionError, match=r"'fn' returned .* as score 3; .*float32.*'the response'"):
        checked_scores("fn", [0.0, value], ["ok", "the response"], first=2)


@pytest.mark.parametrize("value", [FLOAT32_MAX, -FLOAT32_MAX, 1e38, 0, -2.5])
def test_every_value_float32_holds_is_kept_exactly_as_given(value):
    assert checked_scores("fn", [value], ["r"]) == [float(value)]
    assert math.isfinite(torch.tensor([float(value)], dtype=torch.float32).item())


def test_the_scorer_stops_naming_the_function_the_value_and_the_sample(range_module):
    # Two responses per call: the bad sample (index 5) is the second of the third call.
    responses = ["a", "b", "c", "d", "e", "big", "g"]
    with RewardScorer(range_module, timeout_s=30, num_workers=2, chunk_size=2) as scorer:
        assert scorer(["1e38"] * 7, responses).scores == [1.0, 1.0, 1.0, 1.0, 1.0, 1e38, 1.0]
        with pytest.raises(RewardFunctionError, match=rf"'{SPEC}' returned 1e\+39 \(float\) as score 5; .*'big'"):
            scorer(["1e39"] * 7, responses)
