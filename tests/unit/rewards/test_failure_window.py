"""The reward failure-rate limit: a function failing on every call stops the run at its first step,
naming itself and its first error; a passing spike inside a longer window does not."""

import pytest

from megarl.rewards.failure_window import FailureWindow
from megarl.rewards.functions import RewardFunctionError


def test_a_function_that_always_fails_stops_at_the_first_step_naming_its_first_error():
    window = FailureWindow("my_rewards:score", max_fraction=0.5, steps=10)
    with pytest.raises(RewardFunctionError) as raised:
        window.add(failed=128, total=128, first_error="Traceback ...\nKeyError: 'answer'")
    message = str(raised.value)
    assert "'my_rewards:score'" in message and "128 of the 128" in message and "KeyError: 'answer'" in message
    assert "reward.max_failed_fraction = 0.5" in message


def test_a_spike_inside_the_window_passes_and_a_lasting_failure_does_not():
    window = FailureWindow("f", max_fraction=0.5, steps=4)
    for _ in range(3):
        window.add(failed=0, total=100, first_error=None)
    window.add(failed=90, total=100, first_error="ValueError: once")  # 90 / 400 over the window
    window.add(failed=90, total=100, first_error="ValueError: twice")  # 180 / 400
    with pytest.raises(RewardFunctionError, match="ValueError: once"):  # the window's first error
        window.add(failed=100, total=100, first_error=None)  # 280 / 400: the oldest clean step left the window


def test_one_step_windows_judge_each_step():
    window = FailureWindow("f", max_fraction=0.25, steps=1)
    window.add(failed=25, total=100, first_error="E")  # exactly the limit is allowed
    with pytest.raises(RewardFunctionError, match="26 of the 100"):
        window.add(failed=26, total=100, first_error=None)
