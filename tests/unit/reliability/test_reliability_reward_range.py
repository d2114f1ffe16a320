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
        "    return [float(p) if r == 'big' else 1.0 for p, r in zip(prompts, responses)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the scorer hands sys.path to its workers as PYTHONPATH
    return SPEC


def test_float32_max_is_torchs():
    assert torch.finfo(torch.float32).max == FLOAT32_MAX


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


@pytest.mark.parametrize(
    "result, shown",
    [
        (None, "a NoneType (None)"),
        ("1.0", "a str ('1.0')"),
        ({"a": 1.0, "b": 0.0}, "a dict ({'a': 1.0, 'b': 0.0})"),
        (torch.tensor(1.0), "a Tensor (1.0)"),
    ],
    ids=["none", "str", "dict", "scalar-tensor"],
)
def test_a_result_that_is_not_one_score_per_response_is_named(result, shown):
    """A str and a dict were read item by item: '3 scores for 2 responses', or "'a' (str) as score 0"."""
    with pytest.raises(RewardFunctionError) as error:
        checked_scores("fn", result, ["a", "b"])
    assert (
        str(error.value)
        == f"reward.function 'fn' returned {shown}; it must return a list of 2 floats, one per response"
    )


def test_a_tensor_of_scores_is_read_as_its_numbers():
    assert checked_scores("fn", torch.tensor([0.5, 1.0]), ["a", "b"]) == [0.5, 1.0]
