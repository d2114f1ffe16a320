"""`rollout.stop` reaches the engines as stop token ids: the tokenizer's EOS, ids as given, one-token
strings by their id; a multi-token string or an id outside the vocabulary stops the run at start-up,
naming the setting. (The engines ending a sample on `stop_token_ids`: tests/e2e/rollout.)"""

import pytest

from megarl.config.problems import ConfigError
from megarl.models.tiny import build_char_tokenizer
from megarl.trainer.settings import stop_token_ids


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_eos_ids_and_one_token_strings(tokenizer):
    [x] = tokenizer.encode("x", add_special_tokens=False)
    assert stop_token_ids(tokenizer, ()) == (tokenizer.eos_token_id,)
    assert stop_token_ids(tokenizer, ("x", 7, "x")) == (tokenizer.eos_token_id, x, 7)


def test_multi_token_strings_and_unknown_ids_are_config_errors(tokenizer):
    with pytest.raises(ConfigError) as error:
        stop_token_ids(tokenizer, ("ab", len(tokenizer)))
    assert [problem.key for problem in error.value.problems] == ["rollout.stop", "rollout.stop"]
    assert "encodes it as 2 tokens" in str(error.value) and f"the vocabulary has {len(tokenizer)}" in str(error.value)
