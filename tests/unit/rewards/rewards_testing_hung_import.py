"""A reward module whose import never finishes (the scorer's start-up limit must catch it)."""

import threading

threading.Event().wait()


def score(prompts, responses, **columns):
    return [1.0] * len(responses)
