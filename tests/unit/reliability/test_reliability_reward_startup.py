"""A reward module that exists but fails to import is reported when the scorer starts (`wait_ready`),
naming the spec and the import error, so a trainer can check it before starting Ray."""

import pytest

from megarl.rewards.functions import RewardFunctionError
from megarl.rewards.scorer import RewardScorer


@pytest.fixture
def raising_module(tmp_path, monkeypatch):
    (tmp_path / "reliability_raising_reward.py").write_text(
        "import no_such_dependency_xyz\n\ndef score(prompts, responses, **columns):\n    return [0.0] * len(responses)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the scorer hands sys.path to its workers as PYTHONPATH
    return "reliability_raising_reward:score"


def test_wait_ready_raises_naming_the_import_error(raising_module):
    with RewardScorer(raising_module, timeout_s=5, num_workers=2) as scorer:
        with pytest.raises(RewardFunctionError, match=r"'reliability_raising_reward:score'.*no_such_dependency_xyz"):
            scorer.wait_ready()


def test_a_good_function_is_ready_and_scores(tmp_path):
    with RewardScorer("megarl.rewards.tasks:repeat_first_char", timeout_s=5, num_workers=2) as scorer:
        scorer.wait_ready()
        assert scorer(["abc", "bcd"], ["a", "x"], answer=["a", "b"]).scores == [1.0, 0.0]
