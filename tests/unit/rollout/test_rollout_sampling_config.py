"""SamplingConfig validation: good settings pass, each bad one is named, all at once."""

from __future__ import annotations

import pytest

from megarl.workers.rollout import SamplingConfig


def test_defaults_and_typical_settings_are_valid():
    SamplingConfig()
    SamplingConfig(n=8, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=1024, stop_token_ids=(2,), seed=7)
    SamplingConfig(greedy=True, temperature=0.0)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(n=0), "n=0"),
        (dict(greedy=True, n=4), "greedy=True"),
        (dict(temperature=0.0), "set greedy=True"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=0), "top_k=0"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens=5"),
        (dict(min_new_tokens=-1), "min_new_tokens=-1"),
        (dict(stop_token_ids=(2, -1)), "stop_token_ids"),
    ],
)
def test_each_bad_setting_is_named(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**settings)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ValueError) as error:
        SamplingConfig(n=0, top_p=2.0, max_new_tokens=0)
    assert all(key in str(error.value) for key in ("n=0", "top_p=2.0", "max_new_tokens=0"))
