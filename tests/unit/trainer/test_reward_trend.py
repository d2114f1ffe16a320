"""The end line of `megarl train`: the reward over the first and the last steps of the run, read from its
metrics.jsonl (a noisy last step alone said little: the quickstart ended on 0.500 after steps of 0.73-0.88)."""

from megarl.trainer.metrics import reward_trend


def _records(rewards):
    return [{"step": step, "reward/mean": reward} for step, reward in enumerate(rewards, start=1)]


def test_first_and_last_ten_steps_are_averaged():
    rewards = [0.1] * 10 + [0.5] * 80 + [0.9] * 9 + [0.0]
    assert reward_trend(_records(rewards)) == "reward/mean 0.100 over steps 1-10 -> 0.810 over steps 91-100"


def test_a_short_run_splits_its_steps_in_halves_and_skips_unlogged_values():
    records = _records([0.2, None, 0.4, 0.6, 0.8]) + [{"step": 6}]
    assert reward_trend(records) == "reward/mean 0.300 over steps 1-3 -> 0.700 over steps 4-5"


def test_two_steps_name_one_step_each():
    assert reward_trend(_records([0.0, 0.5])) == "reward/mean 0.000 at step 1 -> 0.500 at step 2"


def test_one_step_or_none():
    assert reward_trend(_records([0.25])) == "reward/mean 0.250 at step 1"
    assert reward_trend([{"step": 1}]) == "reward/mean: no step logged it"
