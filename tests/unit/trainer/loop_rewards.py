"""Reward functions that misbehave, for the loop's tests on the fake cluster (run in the reward workers,
which find this module through the test's sys.path)."""


def beyond_float32(prompts, responses, **columns):
    """1e39 for the last response of each call: finite in float64, inf in the trainer's float32, so the
    scorer must stop the run at once."""
    return [1.0] * (len(responses) - 1) + [1e39]


def group_sum_overflow(prompts, responses, **columns):
    """1e38 is a float32, but a group of 8 sums past float32's largest (3.4e38): every GRPO group
    mean is inf, every advantage NaN, so every update's gradient is NaN and every optimizer step skipped."""
    return [1e38] * len(responses)


def wrong_length(prompts, responses, **columns):
    return [1.0]
