"""Reward functions that misbehave, for the trainer's fault tests (run in the reward workers)."""

import time


def flaky(prompts, responses, **columns):
    """Raises on batches whose first prompt starts with 'a', hangs on 'b', scores the rest 1.0."""
    if prompts[0].startswith("a"):
        raise RuntimeError("deliberate reward failure")
    if prompts[0].startswith("b"):
        time.sleep(3600)
    return [1.0] * len(responses)
